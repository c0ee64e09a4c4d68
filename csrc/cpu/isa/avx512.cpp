// The kernels for AVX-512 CPUs (setup.py compiles this file with -mavx512f -mavx512bw ...).
#define ENGINE_EXT_NAME _C_avx512
#define ENGINE_OPS_NS engine_avx512
#include "../ops.cpp"
