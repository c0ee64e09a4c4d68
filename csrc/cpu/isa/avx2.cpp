// The kernels for AVX2 CPUs (setup.py compiles this file with -mavx2 -mfma -mf16c).
#define ENGINE_EXT_NAME _C_avx2
#define ENGINE_OPS_NS engine_avx2
#include "../ops.cpp"
