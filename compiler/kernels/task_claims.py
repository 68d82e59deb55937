"""Tasks of a parallel launch handed out as threads come for them, not split up in advance.

TVM's CPU runtime splits a parallel loop's range into one contiguous share per thread before
the launch. A decode GEMV's tasks read the same bytes each, but a thread that wakes late, or
draws less of the memory system's bandwidth than the others, finishes its share last while
the rest wait at the launch's end with nothing to read. So each site keeps its task loop as
the parallel loop, and task `slot` first walks every task from `slot` on (wrapping), taking
each one no thread has taken yet: a thread's first slot takes its own contiguous share in
order (so its streams still read forward through memory, and one thread reads in the order
it did before), then helps with what is left of the others'. When a walk ends every task is
taken, so it raises the launch's `done` flag and the thread's later slots end at once.

A task is taken with an atomic exchange on its flag: TIR has no atomic for the CPU, so the
three operations below are LLVM IR, imported into the module by TVM's `pragma_import_llvm`
(linkonce_odr: every kernel that imports them shares one copy) and inlined. Which thread
takes a task changes nothing in its arithmetic: the output bits are the same.

In TVMScript the walk is written out around the task loop (x86/q6_k.py's and x86/vnni.py's
`streamed`); with TVM's IR builder, `launch` emits it.
"""

from __future__ import annotations

import contextlib

PRAGMA = "pragma_import_llvm"

# take: 1 if this call took the task (its flag was 0), looking before it writes, since the
# flags of a share another thread has finished are read by every later walk;
# seen: the flag; set: raises it. Relaxed ordering: the flags order nothing else (the
# launch's own barrier publishes the outputs).
IR = r"""
define linkonce_odr i32 @qwc_task_take(ptr %flag) alwaysinline {
entry:
  %seen = load atomic i32, ptr %flag monotonic, align 4
  %free = icmp eq i32 %seen, 0
  br i1 %free, label %try, label %done
try:
  %old = atomicrmw xchg ptr %flag, i32 1 monotonic, align 4
  %took = icmp eq i32 %old, 0
  %r = zext i1 %took to i32
  ret i32 %r
done:
  ret i32 0
}

define linkonce_odr i32 @qwc_task_seen(ptr %flag) alwaysinline {
  %v = load atomic i32, ptr %flag monotonic, align 4
  ret i32 %v
}

define linkonce_odr i32 @qwc_task_set(ptr %flag) alwaysinline {
  store atomic i32 1, ptr %flag monotonic, align 4
  ret i32 0
}
"""


def take(T, flags, i):
    """1 if the caller took task i, 0 if a thread had."""
    return T.call_extern("int32", "qwc_task_take", T.address_of(flags[i]))


def seen(T, flags, i):
    return T.call_extern("int32", "qwc_task_seen", T.address_of(flags[i]))


def set_done(T, flags, i):
    return T.call_extern("int32", "qwc_task_set", T.address_of(flags[i]))


def nth(slot, k, tasks: int):
    """The k-th task of slot `slot`'s walk: slot, slot + 1, ..., wrapping past the last."""
    return (slot + k) % tasks


@contextlib.contextmanager
def launch(T, tasks: int):
    """The same walk for a kernel written with TVM's IR builder: `with launch(T, n) as task:`
    emits the body once, run for each task some thread takes."""
    flags = T.decl_buffer((tasks + 1,), "int32", scope="global")
    with T.serial(0, tasks + 1) as i:
        T.buffer_store(flags, T.int32(0), [i])
    with T.attr(0, PRAGMA, IR):
        with T.parallel(0, tasks) as slot:
            with T.If(seen(T, flags, tasks) == 0):
                with T.Then():
                    with T.serial(0, tasks) as k:
                        task = T.bind(nth(slot, k, tasks))
                        with T.If(take(T, flags, task) == 1):
                            with T.Then():
                                yield task
                    T.evaluate(set_done(T, flags, tasks))
