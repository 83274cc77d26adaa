"""The opcode allow-list of torch's pickled etcd-v2 state: step 2 of :mod:`etcd_rdzv.v2state`.

:func:`scan` walks a pickle's opcodes without building anything and refuses every pickle that torch's
``_RendezvousState`` pickles (protocols 3 to 5, C or Python pickler) are not: no persistent ids,
extension codes or out-of-band buffers, memo indexes within the pickle, tuples nested at most
:data:`MAX_TUPLE_DEPTH` deep (hashing a deeply nested tuple, as unpickling a dict key or set item
does, overflows the C stack of any unpickler: a 1 MB pickle crashes the process), and no more
objects than a state of :data:`MAX_NODES` nodes holds. Pure: no I/O, cost linear in the pickle's size.

The walk is one loop (:func:`_walk`) with the common actions inline and the rare ones in :func:`_rare`:
a Python call per opcode would cost 12-18% on large states.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable

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
_A_PUSH, _A_GET, _A_PUT, _A_MARK, _A_FIXED, _A_MARKED = range(6)  # the common actions, inline in _walk
_A_LOOK, _A_FRAME, _A_PROTO, _A_STOP, _A_REFUSE = range(6, 11)  # the rare ones (_rare); _A_LOOK: see _FIXED
_ARG_LINES, _ARG_LEN1, _ARG_LEN4 = -1, -2, -3
_C_SETS, _C_LISTS, _C_DICTS, _C_OBJECTS, _C_CALLS, _C_TUPLES, _C_FREE = range(7)
_LIMITS = (16, 16, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64, MAX_NODES + 64, 1 << 62)
"""How many of each the pickle may make: sets and lists (torch's state has two sets: empty or set()
of a list), dicts (one per node), objects (NEWOBJ: one per node), calls (REDUCE: one datetime per
heartbeat) and tuples (one per REDUCE); ``_C_FREE`` counts the uncounted (a bound no pickle reaches)."""
_LIMIT_NAMES = ("sets", "lists", "dicts", "objects", "calls", "tuples")
_FIXED = [  # (operands popped, operands left in place, the _K_* pushed or -1, the _C_* counted)
    (0, 0, _K_OTHER, _C_SETS), (0, 0, _K_OTHER, _C_LISTS), (0, 0, _K_OTHER, _C_DICTS),  # EMPTY_*
    (1, 0, _K_TUPLE, _C_TUPLES), (2, 0, _K_TUPLE, _C_TUPLES), (3, 0, _K_TUPLE, _C_TUPLES),  # TUPLE1-3
    (2, 0, _K_OTHER, _C_FREE), (2, 0, _K_OTHER, _C_CALLS), (2, 0, _K_OBJ, _C_OBJECTS),  # STACK_GLOBAL, REDUCE, NEWOBJ
    (1, 1, -1, _C_FREE), (2, 1, -1, _C_FREE), (0, 0, _K_OTHER, _C_FREE),  # BUILD and APPEND, SETITEM, GLOBAL
]
"""The opcodes of a fixed number of operands: ``_A_FIXED`` (inline), or ``_A_LOOK`` where the operands
are looked at as well (TUPLE1-3: no tuple among them; SETITEM: a key a string or an object)."""
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
    "TUPLE1": (_A_LOOK, 0, 3), "TUPLE2": (_A_LOOK, 0, 4), "TUPLE3": (_A_LOOK, 0, 5),
    "STACK_GLOBAL": (_A_FIXED, 0, 6), "REDUCE": (_A_FIXED, 0, 7), "NEWOBJ": (_A_FIXED, 0, 8),
    "BUILD": (_A_FIXED, 0, 9), "APPEND": (_A_FIXED, 0, 9), "SETITEM": (_A_LOOK, 0, 10),
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
    if len(raw) < 3 or raw[0] != 0x80 or not 3 <= raw[1] <= 5:
        raise bad("a pickle not of protocol 3 to 5 (torch writes 4 or 5)")
    _walk(raw, bad, check)


def _walk(raw: bytes, bad: Callable[[str], Exception], check: Callable[[], None]) -> None:
    """:func:`scan`'s loop, the common actions inline (``left``: how many more of each ``_C_*`` the pickle
    may make; ``floor``: ``len(stack)`` at the innermost mark, below which no pop may go)."""
    stack: list[int] = []  # the _K_* of each item
    marks: list[int] = []  # len(stack) at each open MARK
    memo: list[int] = []  # the _K_* of each entry (picklers number them from 0, in order)
    size, table, left, pos, at, floor, tick = len(raw), _TABLE, list(_LIMITS), 0, 0, 0, CHECK_EVERY
    try:
        while True:
            at = pos
            action, arg, n = table[raw[pos]]
            pos += 1
            tick -= 1
            if not tick:
                check()
                tick = CHECK_EVERY
            if arg:  # skip the argument (GET and PUT read theirs: raw[at + 1:pos])
                if arg > 0:
                    pos += arg
                elif arg == _ARG_LEN1:
                    pos += 1 + raw[pos]
                else:
                    pos = _skip(raw, pos, arg, at, bad)
                if pos > size:
                    raise IndexError
            if action == _A_PUSH:
                stack.append(n)
            elif action == _A_GET:
                try:
                    stack.append(memo[raw[pos - 1] if arg == 1 else int.from_bytes(raw[at + 1:pos], "little")])
                except IndexError:
                    raise bad(f"a missing memo entry at byte {at}") from None
            elif action == _A_FIXED:
                pops, keep, result, counted = _FIXED[n]
                if len(stack) - pops - keep < floor:
                    raise bad(f"a malformed pickle (stack underflow at byte {at})")
                left[counted] -= 1
                if left[counted] < 0:
                    raise _too_many(bad, counted)
                if pops:
                    del stack[-pops:]
                if result >= 0:
                    stack.append(result)
            elif action == _A_PUT:  # MEMOIZE (no argument) numbers its entries
                index = len(memo) if not arg else raw[pos - 1] if arg == 1 else int.from_bytes(raw[at + 1:pos], "little")
                if len(stack) <= floor or index > len(memo) or index >= MAX_MEMO:
                    raise bad(f"a malformed memo entry at byte {at}")
                if index == len(memo):
                    memo.append(stack[-1])
                else:
                    memo[index] = stack[-1]
            elif action == _A_MARK:
                floor = len(stack)
                marks.append(floor)
            elif action == _A_MARKED:
                floor = _marked(n, at, stack, marks, left, bad)
            elif _rare(action, n, at, pos, raw, stack, marks, floor, left, bad):  # STOP
                return
    except IndexError:
        raise bad(f"a malformed pickle (truncated at byte {at})") from None


def _skip(raw: bytes, pos: int, arg: int, at: int, bad: Callable[[str], Exception]) -> int:
    """Where the argument of BINUNICODE or BINBYTES (``_ARG_LEN4``) or GLOBAL (two lines) ends."""
    if arg == _ARG_LEN4:
        return pos + 4 + int.from_bytes(raw[pos:pos + 4], "little")
    for _ in (0, 1):
        nl = raw.find(b"\n", pos, pos + 2 * MAX_MESSAGE)
        if nl < 0:
            raise bad(f"a malformed pickle (a global name too long or unterminated at byte {at})")
        pos = nl + 1
    return pos


def _marked(n: int, at: int, stack: list[int], marks: list[int], left: list[int],
            bad: Callable[[str], Exception]) -> int:
    """TUPLE, SETITEMS, APPENDS or ADDITEMS (the items up to the mark); returns the new floor."""
    if not marks:
        raise bad(f"a malformed pickle (no mark for the opcode at byte {at})")
    mark = marks.pop()
    items = stack[mark:]
    del stack[mark:]
    floor = marks[-1] if marks else 0
    if n == _M_TUPLE:
        if _K_TUPLE in items:
            raise bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
        _count(left, _C_TUPLES, bad)
        stack.append(_K_TUPLE)
        return floor
    if len(stack) <= floor:
        raise bad(f"a malformed pickle (stack underflow at byte {at})")
    if n == _M_SETITEMS:
        if len(items) % 2:
            raise bad(f"a malformed pickle (a key without a value at byte {at})")
        items = items[::2]
    if n != _M_APPENDS:
        for kind in items:
            if kind not in _HASHABLE:
                raise _unhashable(bad, kind, at)
    return floor


def _rare(action: int, n: int, at: int, pos: int, raw: bytes, stack: list[int], marks: list[int], floor: int,
          left: list[int], bad: Callable[[str], Exception]) -> bool:
    """The rare actions: ``_A_LOOK``, FRAME (nothing to do), PROTO, STOP (returns True) and the refusals."""
    if action == _A_LOOK:
        pops, keep, result, counted = _FIXED[n]
        if len(stack) - pops - keep < floor:
            raise bad(f"a malformed pickle (stack underflow at byte {at})")
        _count(left, counted, bad)
        if result == _K_TUPLE and _K_TUPLE in stack[len(stack) - pops:]:
            raise bad(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
        if keep and stack[-2] not in _HASHABLE:  # SETITEM
            raise _unhashable(bad, stack[-2], at)
        del stack[len(stack) - pops:]
        if result >= 0:
            stack.append(result)
    elif action == _A_PROTO:
        if at:
            raise bad(f"a malformed pickle (PROTO at byte {at})")
    elif action == _A_STOP:
        if len(stack) != 1 or marks:
            raise bad(f"a malformed pickle ({len(stack)} objects left at STOP)")
        if pos != len(raw):
            raise bad(f"a malformed pickle (data after STOP at byte {at})")
        return True
    elif action == _A_REFUSE:
        name = _NAMES.get(raw[at])
        raise bad(f"opcode {name} at byte {at}" if name else f"a malformed pickle (unknown opcode at byte {at})")
    return False


def _count(left: list[int], counted: int, bad: Callable[[str], Exception]) -> None:
    left[counted] -= 1
    if left[counted] < 0:
        raise _too_many(bad, counted)


def _too_many(bad: Callable[[str], Exception], counted: int) -> Exception:
    return bad(f"more {_LIMIT_NAMES[counted]} than a state of {MAX_NODES} nodes holds")


def _unhashable(bad: Callable[[str], Exception], kind: int, at: int) -> Exception:
    what = "a tuple" if kind == _K_TUPLE else "a value other than a string or an object"
    return bad(f"{what} as a dict key or set item at byte {at} (torch's are strings and nodes)")
