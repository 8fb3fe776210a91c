// One weight type and layout's GEMMs, ESMC_QMM_QUANT and ESMC_QMM_LAYOUT as nvcc's -D gives them
// (cutlass_qmm.py's build compiles this file once for each of ESMC_QMM_EACH_WEIGHT's six pairs).
#include "cutlass_qmm_gemm.cuh"

namespace esmc_qmm {
ESMC_QMM_LAUNCHES(ESMC_QMM_INSTANCE, ESMC_QMM_QUANT, ESMC_QMM_LAYOUT)
}  // namespace esmc_qmm
