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
