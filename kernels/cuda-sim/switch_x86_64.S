# Fiber switch of the CPU executor (x86-64 System V). Saves the callee-saved registers
# on the current stack, stores the stack pointer in *save_sp and resumes the fiber whose
# stack pointer is next_sp. The FP environment (MXCSR, x87 control word) is the same for
# every fiber of a thread, so it is not switched.
#
#   void tsim_switch(void** save_sp, void* next_sp);
#   tsim_fiber_start: where a new fiber's first switch returns to; calls
#   tsim_fiber_main() on a 16-byte aligned stack and never returns.
    .text
    .globl tsim_switch
    .hidden tsim_switch
    .type tsim_switch,@function
tsim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tsim_switch,.-tsim_switch

    .globl tsim_fiber_start
    .hidden tsim_fiber_start
    .type tsim_fiber_start,@function
tsim_fiber_start:
    andq $-16, %rsp
    xorl %ebp, %ebp
    call tsim_fiber_main
    ud2
    .size tsim_fiber_start,.-tsim_fiber_start

    .section .note.GNU-stack,"",@progbits
