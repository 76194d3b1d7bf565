#pragma once
// The host (CPU) backend: the Host tag and every numeric op for it.
#include "dsp/backend/host/convert.hpp"
#include "dsp/backend/host/cross_entropy.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/embedding.hpp"
#include "dsp/backend/host/flash_attention.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/gemm_rounded.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/rms_norm.hpp"
#include "dsp/backend/host/rope.hpp"
#include "dsp/backend/host/router.hpp"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/backend/host/swiglu.hpp"
// Ops written once for every backend on top of the ones above.
#include "dsp/backend/attention.hpp"
#include "dsp/backend/linear.hpp"
