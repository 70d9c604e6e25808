// compile_cuda.cu: dpar.h and dpar_cuda.h with their implementations, through nvcc (make test).
#define DPAR_IMPLEMENTATION
#define DPAR_CUDA_IMPLEMENTATION
#include "dpar_cuda.h"
#include "dpar_cuda.h"
