"""Bound the work of unpickling an untrusted DCP ``.metadata`` before a single object is built.

An allow-list of globals (:mod:`.reader`) stops a pickle from running code, not from costing
unbounded work with harmless objects: a 44 kB file can hold a 100-level tuple DAG
(``t = (t, t)``, each level a memo fetch of the one below), which a dict insertion then hashes
2^100 times with the GIL held; ten million nested tuples overflow every recursive walk.
:func:`scan_pickle` walks the opcode stream (``pickletools.genops``: it decodes, it builds
nothing) and simulates the unpickler's stack with one small record per object, refusing:

* **sharing**: a memo entry fetched again (``GET``) that holds a container (tuple, list, dict,
  set, an object) is an object that appears twice, the building block of a DAG. Only values
  are shared: strings, numbers, classes and a class called on at most :data:`VALUE_ARGS`
  scalars (a dtype, a layout, an enum member: DCP's own files share those);
* **depth**: an object nested more than :data:`MAX_DEPTH` levels, or as many open marks
  (DCP's metadata is about 8 deep);
* **opcodes that metadata never holds**: persistent ids, the extension registry, buffers,
  protocol-0 instance opcodes.

Its cost is linear in the file's length, which :mod:`.reader` caps (:data:`MAX_BYTES`).
With no DAG and a bounded depth, unpickling, hashing and walking the result are linear too.

Source: the opcode semantics of CPython's ``pickle`` / ``pickletools`` modules.
"""

from __future__ import annotations

import pickletools

from ..errors import ShardkitError

__all__ = ["scan_pickle", "MAX_DEPTH", "MAX_BYTES", "VALUE_ARGS"]

MAX_DEPTH = 32
MAX_BYTES = 1 << 30  # a .metadata of 1 GiB describes millions of items; larger is refused unread
VALUE_ARGS = 4

_SCALARS = {
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING",
    "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT",
}  # fmt: skip
_EMPTY = {"EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"}
_FROM_MARK = {"TUPLE", "LIST", "DICT", "FROZENSET"}  # a new container of the items above the mark
_INTO_FROM_MARK = {"APPENDS", "SETITEMS", "ADDITEMS"}  # items above the mark into the container below it
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_IGNORED = {"PROTO", "FRAME", "STOP"}
_REFUSED = {
    "PERSID": "a persistent id",
    "BINPERSID": "a persistent id",
    "EXT1": "an extension-registry code",
    "EXT2": "an extension-registry code",
    "EXT4": "an extension-registry code",
    "INST": "a protocol-0 instance",
    "OBJ": "a protocol-0 instance",
    "NEXT_BUFFER": "an out-of-band buffer",
    "READONLY_BUFFER": "an out-of-band buffer",
    "BYTEARRAY8": "a bytearray",
}


class _Obj:
    """What the scan knows of one object: its nesting depth, and whether it may be shared."""

    __slots__ = ("depth", "shareable")

    def __init__(self, depth: int, shareable: bool) -> None:
        self.depth = depth
        self.shareable = shareable


_SCALAR = _Obj(0, True)


class _Refused(Exception):
    pass


class _Machine:
    def __init__(self) -> None:
        self.stack: list[_Obj] = []
        self.marks: list[int] = []
        self.memo: dict[int, _Obj] = {}

    def pop(self, n: int = 1) -> list[_Obj]:
        if len(self.stack) - (self.marks[-1] if self.marks else 0) < n:
            raise _Refused("an opcode takes more items than the stack holds")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def pop_mark(self) -> list[_Obj]:
        if not self.marks:
            raise _Refused("an opcode needs a mark that was never set")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def push_new(self, items: list[_Obj], shareable: bool = False) -> None:
        self.push(_Obj(1 + max((i.depth for i in items), default=0), shareable))

    def push(self, obj: _Obj) -> None:
        if obj.depth > MAX_DEPTH:
            raise _Refused(f"objects nested more than {MAX_DEPTH} levels deep")
        self.stack.append(obj)

    def fill(self, container: _Obj, items: list[_Obj]) -> None:
        """``items`` put into ``container`` (appended, set, or a ``BUILD`` state), which stays on top."""
        container.depth = max(container.depth, 1 + max((i.depth for i in items), default=0))
        container.shareable = False
        self.push(container)

    def get(self, index) -> None:
        obj = self.memo.get(index)
        if obj is None:
            raise _Refused(f"memo entry {index} is fetched before it was stored")
        if not obj.shareable:
            raise _Refused(
                f"memo entry {index}, a container, is used twice (a shared object: the building block of a "
                "DAG, whose hashing costs exponential time; DCP's metadata never shares one)"
            )
        self.push(obj)

    def put(self, index) -> None:
        if not self.stack or (self.marks and len(self.stack) == self.marks[-1]):
            raise _Refused("a memo store with nothing to store")
        self.memo[index] = self.stack[-1]

    def step(self, name: str, arg) -> None:
        if name in _SCALARS:
            self.push(_SCALAR)
        elif name in _IGNORED:
            pass
        elif name in _REFUSED:
            raise _Refused(f"it holds {_REFUSED[name]} ({name}), which a DCP metadata file never holds")
        elif name == "MARK":
            if len(self.marks) >= MAX_DEPTH:
                raise _Refused(f"more than {MAX_DEPTH} nested marks")
            self.marks.append(len(self.stack))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "STACK_GLOBAL":
                self.pop(2)
            self.push(_Obj(0, True))  # a class or a value of the allow-list (checked by the unpickler)
        elif name in _EMPTY:
            self.push(_Obj(1, name == "EMPTY_TUPLE"))  # () is immutable and empty: a value
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3") or name in _FROM_MARK:
            items = self.pop(int(name[-1])) if name[-1].isdigit() else self.pop_mark()
            # a tuple of a few scalars is a value (the arguments of a dtype, a layout, an enum member)
            small = name.startswith("TUPLE") and len(items) <= VALUE_ARGS and all(i.depth == 0 for i in items)
            self.push_new(items, shareable=small)
        elif name in ("APPEND", "SETITEM"):
            items = self.pop(1 if name == "APPEND" else 2)
            self.fill(self.pop()[0], items)
        elif name in _INTO_FROM_MARK:
            items = self.pop_mark()
            self.fill(self.pop()[0], items)
        elif name == "BUILD":
            state = self.pop()[0]
            self.fill(self.pop()[0], [state])
        elif name in ("REDUCE", "NEWOBJ"):
            args = self.pop()[0]
            self.pop()  # the callable
            # a class called on a value is a value (torch's layout table, an enum member): shareable
            self.push_new([args], shareable=name == "REDUCE" and args.shareable and args.depth <= 1)
        elif name == "NEWOBJ_EX":
            self.push_new(self.pop(3)[1:])
        elif name == "MEMOIZE":
            self.put(len(self.memo))
        elif name in _PUTS:
            self.put(arg)
        elif name in _GETS:
            self.get(arg)
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        else:  # DUP and anything newer
            raise _Refused(f"it holds the opcode {name}, which a DCP metadata file never holds")


def scan_pickle(data: bytes, file: str) -> None:
    """Refuse a pickle whose unpickling could cost more than linear work (see the module).

    Raises:
        ShardkitError: naming ``file`` and what it holds: a shared container, nesting deeper
            than :data:`MAX_DEPTH`, an opcode DCP metadata never holds, or a malformed stream.
    """
    machine = _Machine()
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            machine.step(opcode.name, arg)
    except _Refused as exc:
        raise ShardkitError(f"{file} is refused unread: {exc}") from None
    except (ValueError, EOFError) as exc:  # genops on a truncated or garbage stream
        raise ShardkitError(f"{file} is truncated or not a DCP metadata file ({exc})") from None
