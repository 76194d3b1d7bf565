// doctest's main for dsp_cuda_tests. With --dsp-needs-devices=N (ctest passes it to every test;
// N >= 1 for those labelled `gpu`), a process with fewer than N usable CUDA devices prints why
// and exits 77, which ctest reports as skipped (SKIP_RETURN_CODE 77), so a machine without
// them never counts those tests as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dsp/backend/cuda/device.hpp"

int main(int argc, char** argv) {
  std::vector<char*> args;
  int needs_devices = 0;
  const std::string flag = "--dsp-needs-devices=";
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], flag.c_str(), flag.size()) == 0)
      needs_devices = std::atoi(argv[i] + flag.size());
    else
      args.push_back(argv[i]);
  }
  std::string why = "no error";
  const int devices = needs_devices > 0 ? dsp::backend::device_count(&why) : 0;
  if (devices < needs_devices) {
    std::printf("skipped: needs %d CUDA devices, found %d (%s)\n", needs_devices, devices, why.c_str());
    return 77;
  }
  doctest::Context context(static_cast<int>(args.size()), args.data());
  return context.run();
}
