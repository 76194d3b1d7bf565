#pragma once
// Shared command-line plumbing of the samples: error reporting, --config JSON files and the
// policy the samples run with.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/error.hpp"
#include "dsp/policy.hpp"

namespace samples {

using HostPolicy = dsp::Policy<dsp::backend::Host, dsp::comm::ThreadComm>;

/// The arguments to parse: the config file's as flags, then the command line's.
struct Arguments {
  std::vector<std::string> args;
  std::string config_path;                ///< empty without --config
  std::vector<std::string> config_flags;  ///< the flags whose values come from the file
};

Arguments with_config_file(int argc, char** argv, const CLI::App& app);

/// The long flag of `app` nearest to `flag` by edit distance (Levenshtein), when it is near
/// enough to be a typo or a Megatron/vLLM near-spelling (at most a third of the flag's length,
/// at least 3, apart; "--tensor-parallel-size" -> "--tensor-model-parallel-size"), else "".
inline std::string nearest_flag(const CLI::App& app, const std::string& flag) {
  const auto distance = [](const std::string& a, const std::string& b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  };
  std::string best;
  std::size_t best_d = std::max<std::size_t>(3, flag.size() / 3) + 1;
  for (const CLI::Option* opt : app.get_options(std::function<bool(const CLI::Option*)>{}))
    for (const std::string& name : opt->get_lnames())
      if (const std::size_t d = distance(flag, "--" + name); d < best_d) {
        best_d = d;
        best = "--" + name;
      }
  return best;
}

/// A CLI11 check that a numeric option is at least `min`: "--log-interval: must be >= 1, got 0"
/// (CLI11's own Range prints the type's whole range). A value that does not parse is left to
/// CLI11's conversion error.
inline CLI::Validator at_least(double min) {
  std::ostringstream bound;
  bound << ">= " << min;
  return CLI::Validator(
      [min, bound = bound.str()](std::string& input) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(input.c_str(), &end);
        if (end == input.c_str() || *end != '\0' || value >= min) return {};  // NaN is not >= min
        return "must be " + bound + ", got " + input;
      },
      bound.str());
}

/// Parses the command line (with --config FILE merged in, see with_config_file) and runs body;
/// a dsp or standard error becomes "error: <message>" on stderr and exit code 1, a
/// command-line error CLI11's message and its exit code (naming the config file when a value
/// from it does not convert or validate).
template <class Body>
int run_main(CLI::App& app, int argc, char** argv, Body body) {
  Arguments arguments;
  try {
    std::string config_path;
    app.add_option("--config", config_path,
                   "JSON file of flag values (flags on the command line win; relative paths in it are relative to its folder)");
    app.name(std::filesystem::path(argv[0]).filename().string());  // "Usage: dsp-train [OPTIONS]"
    for (CLI::Option* opt : app.get_options(std::function<bool(CLI::Option*)>{})) {
      if (opt->get_expected_max() <= 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // the command line wins
      opt->capture_default_str();  // --help shows each default
    }
    arguments = with_config_file(argc, argv, app);
    std::vector<std::string> args = arguments.args;
    std::reverse(args.begin(), args.end());  // CLI11 takes the vector form in reverse order
    app.parse(args);
    body();
    return 0;
  } catch (const CLI::ParseError& e) {
    // A value from the config file that does not convert or validate: name the file. CLI11
    // puts the flag's name first ("--x: ...", "Could not convert: --x = ...") or last ("... is
    // not an allowed value for --x").
    const std::string what = e.what();
    const bool value_error = dynamic_cast<const CLI::ConversionError*>(&e) || dynamic_cast<const CLI::ValidationError*>(&e);
    for (const std::string& flag : arguments.config_flags) {
      if (value_error && (what.starts_with(flag + ": ") || what.starts_with("Could not convert: " + flag + " = ") ||
                          what.ends_with(" for " + flag))) {
        std::fprintf(stderr, "error: config file '%s': %s\n", arguments.config_path.c_str(), what.c_str());
        return e.get_exit_code();
      }
    }
    if (dynamic_cast<const CLI::ExtrasError*>(&e)) {  // an unknown flag: suggest the nearest
      for (const std::string& a : arguments.args) {
        const std::string flag = a.substr(0, a.find('='));
        if (!flag.starts_with("--") || app.get_option_no_throw(flag) != nullptr) continue;
        const std::string near = nearest_flag(app, flag);
        std::fprintf(stderr, "error: unknown flag %s%s%s%s (see --help)\n", flag.c_str(), near.empty() ? "" : ": did you mean ",
                     near.c_str(), near.empty() ? "" : "?");
        return e.get_exit_code();
      }
    }
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

/// Turns a JSON config file ({"tensor-model-parallel-size": 2, "lr": 1e-3, "untie-embeddings-
/// and-output-weights": true, ...}; keys are the flags' long names, '_' accepted for '-')
/// into command-line arguments placed before the real ones, so flags override the file: the
/// file's value of a single-value flag the command line also gives is left out (CLI11 would
/// still validate it). Throws dsp::InputError for a missing or malformed file, and for a key
/// that is not one of app's flags (naming the file and the key).
inline Arguments with_config_file(int argc, char** argv, const CLI::App& app) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string path;
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--config") path = args[i + 1];
  for (const auto& a : args)
    if (a.rfind("--config=", 0) == 0) path = a.substr(9);
  if (path.empty()) return {args, {}, {}};
  std::ifstream in(path);
  DSP_CHECK_AS(dsp::InputError, in.good(), "config file '", path, "' cannot be opened");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw dsp::InputError(dsp::detail::concat("config file '", path, "' is not valid JSON: ", e.what()));
  }
  DSP_CHECK_AS(dsp::InputError, j.is_object(), "config file '", path, "' must hold a JSON object");
  // DeepSpeed's nested keys and the flags that say the same.
  static const std::map<std::string, std::string> deepspeed = {
      {"zero_optimization", "zero-stage"},         {"bf16", "bf16"},
      {"fp16", "fp16 (and --initial-loss-scale)"}, {"optimizer", "lr, --weight-decay"},
      {"scheduler", "lr-warmup-iters, --min-lr"}};
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::vector<std::string> from_file, flags;
  for (const auto& [key, value] : j.items()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (value.is_object()) {
      const auto ds = deepspeed.find(key);
      throw dsp::InputError(dsp::detail::concat(
          "config file '", path, "': key '", key, "' holds a nested object (DeepSpeed's style); dsp config files are flat, ",
          "one flag per key", ds == deepspeed.end() ? std::string(" (see --help)") : ": use --" + ds->second));
    }
    const CLI::Option* option = app.get_option_no_throw(flag);
    if (option == nullptr) {
      const std::string near = nearest_flag(app, flag);
      throw dsp::InputError(dsp::detail::concat("config file '", path, "': ", flag, " is not a flag of this program",
                                                near.empty() ? " (see --help)" : " (did you mean " + near + "?)"));
    }
    const bool on_command_line =
        std::any_of(args.begin(), args.end(), [&](const std::string& a) { return a == flag || a.starts_with(flag + "="); });
    if (on_command_line && option->get_expected_max() <= 1) continue;
    flags.push_back(flag);
    // A relative path in the file is relative to the file's folder (a flag whose type name is
    // PATH: see path_option).
    const bool is_path = option->get_type_name() == "PATH";
    const auto text = [&](const nlohmann::json& v, bool path) {
      std::string s = v.is_string() ? v.get<std::string>() : v.dump();
      if (path && v.is_string() && !s.empty() && std::filesystem::path(s).is_relative() && !folder.empty())
        s = (folder / s).string();
      return s;
    };
    if (value.is_boolean()) {
      if (value.get<bool>()) from_file.push_back(flag);
    } else if (value.is_array()) {  // a flag of several values: "data-path": [0.3, "a", 0.7, "b"]
      from_file.push_back(flag);
      // pairs of a PATH flag are WEIGHT PATH (a blend): the weights, at even places, are no paths
      const bool pairs = value.size() >= 2 && value.size() % 2 == 0;
      for (std::size_t k = 0; k < value.size(); ++k) from_file.push_back(text(value[k], is_path && !(pairs && k % 2 == 0)));
    } else {
      from_file.push_back(flag);
      from_file.push_back(text(value, is_path));
    }
  }
  args.insert(args.begin(), from_file.begin(), from_file.end());
  return {args, path, flags};
}

/// Marks `opt` as a file or folder path (type name PATH): in a --config file its relative
/// value is taken relative to the file's folder. Returns opt.
inline CLI::Option* path_option(CLI::Option* opt) { return opt->type_name("PATH"); }

/// `text` with every two-character sequence "\\n" replaced by a newline.
inline std::string unescape_newlines(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == 'n') {
      out += '\n';
      ++i;
    } else {
      out += text[i];
    }
  }
  return out;
}

/// Prompts for the serving samples: one per line of `path`, with the two characters "\n"
/// standing for a newline. Throws dsp::InputError when the file cannot be read or is empty,
/// and for a blank line (naming its number: a prompt is never silently dropped).
inline std::vector<std::string> read_prompts_file(const std::string& path) {
  std::ifstream in(path);
  DSP_CHECK_AS(dsp::InputError, in.good(), "prompts file '", path, "' cannot be opened");
  std::vector<std::string> prompts;
  std::size_t number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF files
    DSP_CHECK_AS(dsp::InputError, !line.empty(), "prompts file '", path, "' line ", number,
                 " is blank: one prompt per line (write \\n for a newline inside a prompt)");
    prompts.push_back(unescape_newlines(line));
  }
  DSP_CHECK_AS(dsp::InputError, !prompts.empty(), "prompts file '", path, "' holds no prompt");
  return prompts;
}

}  // namespace samples
