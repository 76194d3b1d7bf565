#pragma once
// The JSON-lines metrics file of a run that may be resumed: opened for a run starting at
// iteration N, it keeps only the records of steps 1..N (those of the checkpoint it resumes
// from) before appending, so that a run killed after its last save and resumed lists every
// step exactly once.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::train {

/// Opens `path` (its parent folders created) for appending the records of a run that starts
/// after iteration `start`: with start == 0 the file is truncated; otherwise the lines whose
/// "step" is at most `start` are kept and every other line (later steps, or a line cut short
/// by a kill) is dropped. Throws InputError naming the file when it cannot be read or written.
inline std::ofstream open_metrics_log(const std::filesystem::path& path, std::int64_t start) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  DSP_CHECK_AS(InputError, !ec, "cannot create the folder of metrics file '", path.string(), "': ", ec.message());
  std::vector<std::string> kept;
  if (start > 0 && std::filesystem::exists(path, ec)) {
    std::ifstream in(path);
    DSP_CHECK_AS(InputError, in.good(), "cannot read metrics file '", path.string(), "'");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<std::int64_t>() <= start)
        kept.push_back(line);
    }
  }
  std::ofstream out(path, std::ios::trunc);
  DSP_CHECK_AS(InputError, out.good(), "cannot write metrics file '", path.string(), "'");
  for (const auto& line : kept) out << line << '\n';
  out.flush();
  return out;
}

}  // namespace dsp::train
