"""The training application behind ``shardkit train``, importable without the command line.

One rank's run (:mod:`.run`: mesh, parallelize, the step loop, the report dict) and the one
``train_step`` (:mod:`.trainer`); the options (:mod:`.options`), their checks (:mod:`.config`,
whose torch-free first half is :mod:`.config_file` and :mod:`.layout`; the machine's limits
:mod:`.limits`, the checkpoint directory :mod:`.checkpoint_dir`); the
model-spec registry (:mod:`.specs`: every ``--model``'s rules, model, task and parallelization)
with the decoder LMs' hooks (:mod:`.lm_spec`, :mod:`.lm_families`, :mod:`.model`,
:mod:`.pretrained`, :mod:`.lm_task`) and the conv autoencoder's (:mod:`.conv_spec`,
:mod:`.conv_ae`); the data (:mod:`.data`,
:mod:`.corpus`, :mod:`.tokens`); the learning-rate schedule, metrics, progress, heartbeats and
``--verify`` (:mod:`.schedule`, :mod:`.metrics`, :mod:`.progress`, :mod:`.liveness`, :mod:`.watchdog`,
:mod:`.verify`). :mod:`shardkit.cli` is the front door only: flags, launch, report.

Nothing is imported here: ``import shardkit.train.config`` stays free of torch.distributed's
launcher and of transformers.
"""
