"""The opcode allow-list of torch's pickled etcd-v2 state: step 2 of :mod:`etcd_rdzv.v2state`.

:func:`scan` walks a pickle's opcodes without building anything and refuses every pickle that torch's
``_RendezvousState`` pickles (protocols 3 to 5, C or Python pickler) are not: no persistent ids,
extension codes or out-of-band buffers, memo indexes within the pickle, tuples nested at most
:data:`MAX_TUPLE_DEPTH` deep (hashing a deeply nested tuple, as unpickling a dict key or set item
does, overflows the C stack of any unpickler: a 1 MB pickle crashes the process), and no more
objects than a state of :data:`MAX_NODES` nodes holds. Pure: no I/O, cost linear in the pickle's size.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from typing import Any

MAX_NODES = 16_384
"""The most nodes a state may name in each of its collections and build: etcd's default request limit
(1.5 MiB of base64) holds ~10,000 nodes of real host names; 16,384 of one-letter names fit in ~750 KB
and decode within the 0.5 s of docs/security.md."""

MAX_MEMO = 8 * MAX_NODES + 1024  # memo entries (torch writes ~7 per node; the C unpickler sizes its memo by it)
MAX_TUPLE_DEPTH = 1  # how deep tuples may nest in a state (torch's never nest a tuple in a tuple)
MAX_MESSAGE = 200  # the most characters of text taken from a value that an error message carries

# The opcodes torch's states use, as the C and Python picklers write them, and what scan does with each.
# Every other opcode is refused.
_K_OTHER, _K_STR, _K_TUPLE, _K_OBJ = range(4)  # what a stack item is (what a dict key or set item may be)
_HASHABLE = (_K_STR, _K_OBJ)  # str hashes are cached; the stand-ins hash by identity
_A_PUSH, _A_GET, _A_PUT, _A_MARK, _A_FIXED, _A_MARKED, _A_FRAME, _A_PROTO, _A_STOP, _A_REFUSE = range(10)
_ARG_LINES, _ARG_LEN1, _ARG_LEN4 = -1, -2, -3
_C_SETS, _C_LISTS, _C_DICTS, _C_OBJECTS, _C_CALLS, _C_TUPLES = range(6)
_LIMITS = (16, 16, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64)
"""How many of each the pickle may make: sets and lists (torch's state has two sets: empty or set()
of a list), dicts (one per node), objects (NEWOBJ: one per node), calls (REDUCE: one datetime per
heartbeat) and tuples (one per REDUCE)."""
_LIMIT_NAMES = ("sets", "lists", "dicts", "objects", "calls", "tuples")
_FIXED = [  # (operands popped, operands left in place, the _K_* pushed or -1, the _C_* counted or -1)
    (0, 0, _K_OTHER, _C_SETS), (0, 0, _K_OTHER, _C_LISTS), (0, 0, _K_OTHER, _C_DICTS),  # EMPTY_*
    (1, 0, _K_TUPLE, _C_TUPLES), (2, 0, _K_TUPLE, _C_TUPLES), (3, 0, _K_TUPLE, _C_TUPLES),  # TUPLE1-3
    (2, 0, _K_OTHER, -1), (2, 0, _K_OTHER, _C_CALLS), (2, 0, _K_OBJ, _C_OBJECTS),  # STACK_GLOBAL, REDUCE, NEWOBJ
    (1, 1, -1, -1), (2, 1, -1, -1), (0, 0, _K_OTHER, -1),  # BUILD and APPEND, SETITEM, GLOBAL
]
_M_TUPLE, _M_SETITEMS, _M_APPENDS, _M_ADDITEMS = range(4)
_WHITELIST: dict[str, tuple[int, int, int]] = {  # name: (action, argument bytes or _ARG_*, detail)
    "PROTO": (_A_PROTO, 1, 0), "FRAME": (_A_FRAME, 8, 0), "STOP": (_A_STOP, 0, 0),
    "NONE": (_A_PUSH, 0, _K_OTHER), "NEWTRUE": (_A_PUSH, 0, _K_OTHER), "NEWFALSE": (_A_PUSH, 0, _K_OTHER),
    "BININT": (_A_PUSH, 4, _K_OTHER), "BININT1": (_A_PUSH, 1, _K_OTHER), "BININT2": (_A_PUSH, 2, _K_OTHER),
    "LONG1": (_A_PUSH, _ARG_LEN1, _K_OTHER),
    "SHORT_BINBYTES": (_A_PUSH, _ARG_LEN1, _K_OTHER), "BINBYTES": (_A_PUSH, _ARG_LEN4, _K_OTHER),
    "SHORT_BINUNICODE": (_A_PUSH, _ARG_LEN1, _K_STR), "BINUNICODE": (_A_PUSH, _ARG_LEN4, _K_STR),
    "EMPTY_TUPLE": (_A_PUSH, 0, _K_TUPLE),
    "EMPTY_SET": (_A_FIXED, 0, 0), "EMPTY_LIST": (_A_FIXED, 0, 1), "EMPTY_DICT": (_A_FIXED, 0, 2),
    "TUPLE1": (_A_FIXED, 0, 3), "TUPLE2": (_A_FIXED, 0, 4), "TUPLE3": (_A_FIXED, 0, 5),
    "STACK_GLOBAL": (_A_FIXED, 0, 6), "REDUCE": (_A_FIXED, 0, 7), "NEWOBJ": (_A_FIXED, 0, 8),
    "BUILD": (_A_FIXED, 0, 9), "APPEND": (_A_FIXED, 0, 9), "SETITEM": (_A_FIXED, 0, 10),
    "GLOBAL": (_A_FIXED, _ARG_LINES, 11),
    "TUPLE": (_A_MARKED, 0, _M_TUPLE), "SETITEMS": (_A_MARKED, 0, _M_SETITEMS),
    "APPENDS": (_A_MARKED, 0, _M_APPENDS), "ADDITEMS": (_A_MARKED, 0, _M_ADDITEMS),
    "MARK": (_A_MARK, 0, 0),
    "BINPUT": (_A_PUT, 1, 0), "LONG_BINPUT": (_A_PUT, 4, 0), "MEMOIZE": (_A_PUT, 0, 0),
    "BINGET": (_A_GET, 1, 0), "LONG_BINGET": (_A_GET, 4, 0),
}
_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_TABLE = tuple(_WHITELIST.get(_NAMES.get(code, ""), (_A_REFUSE, 0, 0)) for code in range(256))
CHECK_EVERY = 1 << 14  # opcodes between two looks at the clock (also the budget's elements between two)


def scan(raw: bytes, bad: Callable[[str], Exception], check: Callable[[], None]) -> None:
    """Walk the opcodes of ``raw`` (no object is built); raise ``bad(what)`` for what must not be loaded.

    Admits only the opcodes torch's states use (:data:`_WHITELIST`), each used as a pickler uses it:
    every pop within the current mark, memo entries numbered in order (at most :data:`MAX_MEMO`), no
    tuple inside a tuple, one object left at STOP and nothing after it, and no more containers,
    tuples, calls and objects than a state of :data:`MAX_NODES` nodes holds (:data:`_LIMITS`: what
    bounds the memory a pickle makes the unpickler allocate, ~20 bytes per byte of pickle at most).
    Tracks what each stack item is, so that every dict key and set item (what the unpickler hashes)
    is a string (its hash is cached) or an object of NEWOBJ (a stand-in, hashed by identity): no
    tuple, number or other value whose hash costs its size or can be made to collide.
    ``check()`` (the decode's budget) is called every :data:`CHECK_EVERY` opcodes.
    """
    walk = _Walk(raw, bad)
    if len(raw) < 3 or raw[0] != 0x80 or not 3 <= raw[1] <= 5:
        raise bad("a pickle not of protocol 3 to 5 (torch writes 4 or 5)")
    actions, push = walk.actions(), walk.stack.append
    size, table, pos, at, tick = len(raw), _TABLE, 0, 0, CHECK_EVERY
    try:
        while True:
            at = pos
            action, arg, n = table[raw[pos]]
            pos += 1
            tick -= 1
            if not tick:
                check()
                tick = CHECK_EVERY
            value = None
            if arg:  # the argument
                if arg > 0:
                    value = raw[pos] if arg == 1 else int.from_bytes(raw[pos:pos + arg], "little")
                    pos += arg
                elif arg == _ARG_LEN1:
                    pos += 1 + raw[pos]
                elif arg == _ARG_LEN4:
                    pos += 4 + int.from_bytes(raw[pos:pos + 4], "little")
                else:  # _ARG_LINES
                    for _ in (0, 1):
                        nl = raw.find(b"\n", pos, pos + 2 * MAX_MESSAGE)
                        if nl < 0:
                            raise bad(f"a malformed pickle (a global name too long or unterminated at byte {at})")
                        pos = nl + 1
                if pos > size:
                    raise IndexError
            if action == _A_PUSH:  # the commonest, inline
                push(n)
            elif actions[action](n, value, at):  # STOP
                if pos != size:
                    raise bad(f"a malformed pickle (data after STOP at byte {at})")
                return
    except IndexError:
        raise bad(f"a malformed pickle (truncated at byte {at})") from None


class _Walk:
    """What :func:`scan` knows of the pickle so far, and one method per ``_A_*`` action.

    Each method takes the opcode's detail ``n`` (of :data:`_WHITELIST`), its integer argument
    (``None`` without one) and its byte offset; only STOP's returns True.
    """

    __slots__ = ("raw", "bad", "stack", "marks", "memo", "left", "floor")

    def __init__(self, raw: bytes, bad: Callable[[str], Exception]) -> None:
        self.raw, self.bad = raw, bad
        self.stack: list[int] = []  # the _K_* of each item
        self.marks: list[int] = []  # len(stack) at each open MARK
        self.memo: list[int] = []  # the _K_* of each entry (picklers number them from 0, in order)
        self.left = list(_LIMITS)  # how many more of each counted kind the pickle may make
        self.floor = 0  # len(stack) at the innermost mark: no pop may go below it

    def actions(self) -> tuple[Any, ...]:
        """The methods in the order of the ``_A_*`` numbers (FRAME does nothing)."""
        push = self.stack.append
        return (lambda n, value, at: push(n), self.memo_get, self.memo_put, self.mark, self.fixed, self.marked,
                lambda n, value, at: None, self.proto, self.stop, self.refuse)

    def unhashable(self, kind: int, at: int) -> Exception:
        what = "a tuple" if kind == _K_TUPLE else "a value other than a string or an object"
        return self.bad(f"{what} as a dict key or set item at byte {at} (torch's are strings and nodes)")

    def count(self, counted: int) -> None:
        self.left[counted] -= 1
        if self.left[counted] < 0:
            raise self.bad(f"more {_LIMIT_NAMES[counted]} than a state of {MAX_NODES} nodes holds")

    def memo_get(self, n: int, value: int, at: int) -> None:
        if value >= len(self.memo):
            raise self.bad(f"a missing memo entry at byte {at}")
        self.stack.append(self.memo[value])

    def memo_put(self, n: int, value: int | None, at: int) -> None:
        memo, stack = self.memo, self.stack
        index = len(memo) if value is None else value  # MEMOIZE numbers its entries
        if len(stack) <= self.floor or index > len(memo) or index >= MAX_MEMO:
            raise self.bad(f"a malformed memo entry at byte {at}")
        if index == len(memo):
            memo.append(stack[-1])
        else:
            memo[index] = stack[-1]

    def mark(self, n: int, value: int | None, at: int) -> None:
        self.floor = len(self.stack)
        self.marks.append(self.floor)

    def fixed(self, n: int, value: int | None, at: int) -> None:
        """An opcode of a fixed number of operands (:data:`_FIXED`)."""
        stack = self.stack
        pops, keep, result, counted = _FIXED[n]
        if len(stack) - pops - keep < self.floor:
            raise self.bad(f"a malformed pickle (stack underflow at byte {at})")
        if counted >= 0:
            self.count(counted)
        if result == _K_TUPLE and _K_TUPLE in stack[len(stack) - pops:]:
            raise self.bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
        if keep and pops == 2 and stack[-2] not in _HASHABLE:  # SETITEM
            raise self.unhashable(stack[-2], at)
        if pops:
            del stack[len(stack) - pops:]
        if result >= 0:
            stack.append(result)

    def marked(self, n: int, value: int | None, at: int) -> None:
        """An opcode that takes the items up to the mark: TUPLE, SETITEMS, APPENDS, ADDITEMS."""
        stack, marks = self.stack, self.marks
        if not marks:
            raise self.bad(f"a malformed pickle (no mark for the opcode at byte {at})")
        mark = marks.pop()
        items = stack[mark:]
        del stack[mark:]
        self.floor = marks[-1] if marks else 0
        if n == _M_TUPLE:
            if _K_TUPLE in items:
                raise self.bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
            self.count(_C_TUPLES)
            stack.append(_K_TUPLE)
            return
        if len(stack) <= self.floor:
            raise self.bad(f"a malformed pickle (stack underflow at byte {at})")
        if n == _M_SETITEMS:
            if len(items) % 2:
                raise self.bad(f"a malformed pickle (a key without a value at byte {at})")
            items = items[::2]
        if n != _M_APPENDS:
            for kind in items:
                if kind not in _HASHABLE:
                    raise self.unhashable(kind, at)

    def proto(self, n: int, value: int | None, at: int) -> None:
        if at:
            raise self.bad(f"a malformed pickle (PROTO at byte {at})")

    def stop(self, n: int, value: int | None, at: int) -> bool:
        if len(self.stack) != 1 or self.marks:
            raise self.bad(f"a malformed pickle ({len(self.stack)} objects left at STOP)")
        return True

    def refuse(self, n: int, value: int | None, at: int) -> None:
        name = _NAMES.get(self.raw[at])
        raise self.bad(f"opcode {name} at byte {at}" if name else f"a malformed pickle (unknown opcode at byte {at})")
