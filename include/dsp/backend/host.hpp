#pragma once
// The host (CPU) backend: the Host tag and every numeric op for it.
#include "dsp/backend/host/attention.hpp"
#include "dsp/backend/host/cross_entropy.hpp"
#include "dsp/backend/host/elementwise.hpp"
#include "dsp/backend/host/embedding.hpp"
#include "dsp/backend/host/gemm.hpp"
#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/linear.hpp"
#include "dsp/backend/host/rms_norm.hpp"
#include "dsp/backend/host/rope.hpp"
#include "dsp/backend/host/sigmoid.hpp"
#include "dsp/backend/host/softmax.hpp"
#include "dsp/backend/host/swiglu.hpp"
