/* compile_cuda_c.c: plain C sees dpar_cuda.h's declarations without nvcc (make test). */
#include "dpar_cuda.h"

int compile_cuda_c_uses(void);
int compile_cuda_c_uses(void)
{
    int n = 0;
    return dpar_cuda_device_count(&n) == DPAR_OK ? n : -1;
}
