/* interlace hot path, native half: the unwind-terminating trampoline.
 *
 * A worker greenlet's C stack begins wherever it was first switched to and is later resumed
 * under other frames, so what lies above its first frame can be dead or someone else's. An
 * unwinder that walks past that frame (torch's c10::Error records a backtrace with
 * _Unwind_Backtrace) reads garbage and can crash. ilh_trampoline's DWARF CFI says its return
 * address is undefined, as glibc's _start and clone do: every unwinder (libgcc, libunwind,
 * gdb) stops there. Mechanism only; the pool's policy is in interlace/intervention/mediator.py.
 */
#define PY_SSIZE_T_CLEAN
#include "_chotpath_impl.h"

typedef PyObject *(*ilh_callback)(PyObject *);

#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
const int ILH_UNWIND_STOP = 1;
/* PyObject *ilh_trampoline(ilh_callback fn, PyObject *arg): returns fn(arg). */
PyObject *ilh_trampoline(ilh_callback fn, PyObject *arg);
#  if defined(__x86_64__)
/* At entry rsp is 8 mod 16 (the call pushed the return address); the push makes it 16-aligned
   for the call, as the SysV ABI requires. */
__asm__(
    "    .text\n"
    "    .globl ilh_trampoline\n"
    "    .hidden ilh_trampoline\n"
    "    .type ilh_trampoline, @function\n"
    "    .p2align 4\n"
    "ilh_trampoline:\n"
    "    .cfi_startproc\n"
    "    .cfi_undefined rip\n"
    "    pushq %rbp\n"
    "    .cfi_def_cfa_offset 16\n"
    "    .cfi_offset rbp, -16\n"
    "    movq %rsp, %rbp\n"
    "    .cfi_def_cfa_register rbp\n"
    "    movq %rdi, %rax\n"
    "    movq %rsi, %rdi\n"
    "    callq *%rax\n"
    "    popq %rbp\n"
    "    .cfi_def_cfa rsp, 8\n"
    "    ret\n"
    "    .cfi_endproc\n"
    "    .size ilh_trampoline, .-ilh_trampoline\n");
#  else
/* The frame record (x29, x30) keeps sp 16-aligned; x30 is saved but not described, so the
   return address column stays undefined. */
__asm__(
    "    .text\n"
    "    .globl ilh_trampoline\n"
    "    .hidden ilh_trampoline\n"
    "    .type ilh_trampoline, %function\n"
    "    .p2align 2\n"
    "ilh_trampoline:\n"
    "    .cfi_startproc\n"
    "    .cfi_undefined x30\n"
    "    stp x29, x30, [sp, #-16]!\n"
    "    .cfi_def_cfa_offset 16\n"
    "    .cfi_offset x29, -16\n"
    "    mov x29, sp\n"
    "    mov x16, x0\n"
    "    mov x0, x1\n"
    "    blr x16\n"
    "    ldp x29, x30, [sp], #16\n"
    "    .cfi_def_cfa_offset 0\n"
    "    .cfi_restore x29\n"
    "    ret\n"
    "    .cfi_endproc\n"
    "    .size ilh_trampoline, .-ilh_trampoline\n");
#  endif
#else
const int ILH_UNWIND_STOP = 0;
static PyObject *ilh_trampoline(ilh_callback fn, PyObject *arg) { return fn(arg); }
#endif

static PyObject *
call_noargs(PyObject *fn)
{
    return PyObject_CallNoArgs(fn);
}

PyObject *
ilh_outermost(PyObject *fn)
{
    return ilh_trampoline(call_noargs, fn);
}

/* ---- ilh_call_below (h-sweep) ---------------------------------------------------------------
 * A greenlet's C stack starts where it is first switched to. When the side that resumes it
 * later runs deeper than that (a model's forward calls the hook that switches to a body
 * started before the forward began), greenlet copies the part of the resumer's stack that
 * overlaps the greenlet's to the heap and back, on every switch pair: the larger part of a
 * switch's cost. A worker first switched to inside ilh_call_below starts `depth` bytes below
 * its creator, under the model side's stack, so that nothing of the model's stack is copied.
 * Only where the thread's stack has room for twice `depth` and a margin (its bounds from
 * pthread_getattr_np, once per thread); elsewhere a plain call.
 */
#if defined(__linux__)
#include <alloca.h>
#include <pthread.h>

static __thread char *ilh_stack_low;  /* lowest address of this thread's stack, once known */
static __thread int ilh_stack_known;

static char *
stack_low(void)
{
    if (!ilh_stack_known) {
        pthread_attr_t attr;
        void *addr = NULL;
        size_t size = 0;
        ilh_stack_known = 1;
        if (pthread_getattr_np(pthread_self(), &attr) == 0) {
            if (pthread_attr_getstack(&attr, &addr, &size) == 0)
                ilh_stack_low = (char *)addr;
            pthread_attr_destroy(&attr);
        }
    }
    return ilh_stack_low;
}

PyObject *
ilh_call_below(Py_ssize_t depth, PyObject *fn)
{
    char here;
    char *low = stack_low();
    if (depth > 0 && low != NULL && &here > low
            && (size_t)(&here - low) > 2 * (size_t)depth + ((size_t)1 << 16)) {
        volatile char *reserved = alloca((size_t)depth);
        PyObject *result;
        reserved[0] = 0;
        result = PyObject_CallNoArgs(fn);
        __asm__ volatile("" : : "r"(reserved) : "memory");  /* kept until fn returned */
        return result;
    }
    return PyObject_CallNoArgs(fn);
}
#else
PyObject *
ilh_call_below(Py_ssize_t depth, PyObject *fn)
{
    (void)depth;
    return PyObject_CallNoArgs(fn);
}
#endif
/* ---- end of ilh_call_below ---- */
