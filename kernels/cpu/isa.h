/* Which vector instruction set a kernel library was compiled for, as kernels/cpu_build.py
 * names it: the host's widest with -march=native, narrower where NATSLLM_CPU_ISA asks
 * (the tests build each kernel both ways). Included once per library. */
#ifndef NATSLLM_ISA_H
#define NATSLLM_ISA_H

const char *natsllm_kernel_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "generic";
#endif
}
#endif
