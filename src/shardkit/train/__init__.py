"""The training application behind ``shardkit train``, importable without the command line.

One rank's run (:mod:`.run`: mesh, parallelize, the step loop, the report dict) and the one
``train_step`` (:mod:`.trainer`); the configuration and its rules (:mod:`.config`, the machine's
limits :mod:`.limits`, the checkpoint directory :mod:`.checkpoint_dir`); the models and tasks
(:mod:`.model`, :mod:`.pretrained`, :mod:`.lm_task`, :mod:`.conv_ae`); the data (:mod:`.data`,
:mod:`.corpus`, :mod:`.tokens`); the learning-rate schedule, metrics, progress, heartbeats and
``--verify`` (:mod:`.schedule`, :mod:`.metrics`, :mod:`.progress`, :mod:`.liveness`,
:mod:`.verify`). :mod:`shardkit.cli` is the front door only: flags, launch, report.

Nothing is imported here: ``import shardkit.train.config`` stays free of torch.distributed's
launcher and of transformers.
"""
