/* compile_cuda_main.c: a plain C main linked against the nvcc-built implementation of dpar_cuda.h
   (tests/gpu.sh): the declarations seen from C reach the code nvcc compiled. */
#include <stdio.h>

int compile_cuda_c_uses(void);

int main(void)
{
    int n = compile_cuda_c_uses(); /* the device count, or -1: a link or call failure shows here */
    printf("dpar_cuda_device_count from C: %d\n", n);
    return n < 0 ? 1 : 0;
}
