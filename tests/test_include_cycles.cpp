// No folder under include/dsp includes a folder that includes it back (DESIGN.md section 5:
// dependencies point one way, core <- backend <- comm <- parallel <- tp/ep <- model <-
// pp/dp/zero <- train/serve/checkpoint/plan). The test reads every header's #include lines,
// builds the graph "folder A includes a header of folder B", and fails naming one cycle and the
// include line behind each of its edges. A second case runs the same check on a small tree with
// a cycle written on purpose and checks that it is found.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "data_dir.hpp"
#include "temp_dir.hpp"

namespace dsp::test::include_cycles {

namespace fs = std::filesystem;

/// edges[A][B]: where a header of folder A includes one of folder B ("A/x.hpp:12").
using FolderGraph = std::map<std::string, std::map<std::string, std::string>>;

/// The folder graph of the headers under `root` (the include/dsp folder): for every file under
/// a folder of root, each `#include "dsp/B/..."` or `<dsp/B/...>` with B another folder.
/// Headers directly in root (the umbrella header) belong to no folder and are skipped.
FolderGraph folder_graph(const fs::path& root) {
  static const std::regex include_line(R"(^\s*#\s*include\s*[<"]dsp/([A-Za-z0-9_]+)/)");
  FolderGraph graph;
  for (const auto& folder : fs::directory_iterator(root)) {
    if (!folder.is_directory()) continue;
    const std::string from = folder.path().filename().string();
    graph[from];
    for (const auto& file : fs::recursive_directory_iterator(folder.path())) {
      if (!file.is_regular_file()) continue;
      std::ifstream in(file.path());
      std::string line;
      for (int number = 1; std::getline(in, line); ++number) {
        std::smatch m;
        if (!std::regex_search(line, m, include_line) || m[1] == from) continue;
        graph[from].emplace(m[1], fs::relative(file.path(), root).string() + ":" + std::to_string(number));
      }
    }
  }
  return graph;
}

/// One cycle of the graph as "a -> b (a/x.hpp:3) -> a (b/y.hpp:7)", or nullopt when it has none
/// (depth-first search; a node on the current path reached again closes a cycle).
std::optional<std::string> find_cycle(const FolderGraph& graph) {
  std::map<std::string, int> state;  // 0 unvisited, 1 on the path, 2 done
  std::vector<std::string> path;
  std::optional<std::string> found;
  auto visit = [&](auto&& self, const std::string& node) -> void {
    state[node] = 1;
    path.push_back(node);
    if (const auto it = graph.find(node); it != graph.end())
      for (const auto& [next, where] : it->second) {
        if (found) break;
        if (state[next] == 1) {
          std::size_t start = 0;
          while (path[start] != next) ++start;
          std::string text = path[start];
          for (std::size_t i = start; i < path.size(); ++i) {
            const std::string& to = i + 1 < path.size() ? path[i + 1] : next;
            text += " -> " + to + " (" + graph.at(path[i]).at(to) + ")";
          }
          found = text;
        } else if (state[next] == 0) {
          self(self, next);
        }
      }
    path.pop_back();
    state[node] = 2;
  };
  for (const auto& [node, edges] : graph)
    if (!found && state[node] == 0) visit(visit, node);
  return found;
}

TEST_CASE("no folder under include/dsp includes a folder that includes it back") {
  const fs::path root = fs::path(data_dir()) / ".." / "include" / "dsp";
  REQUIRE(fs::is_directory(root));
  const FolderGraph graph = folder_graph(root);
  REQUIRE(graph.count("model") == 1);  // the scan saw the folders
  REQUIRE(graph.at("model").count("core") == 1);  // and their includes
  const auto cycle = find_cycle(graph);
  INFO("include cycle: ", cycle.value_or(""));
  CHECK_FALSE(cycle.has_value());
}

TEST_CASE("the include-cycle check finds a cycle written on purpose") {
  TempDir dir;
  const auto write = [&](const std::string& name, const std::string& text) {
    fs::create_directories((dir / name).parent_path());
    std::ofstream(dir / name) << text;
  };
  write("a/x.hpp", "#pragma once\n#include \"dsp/core/error.hpp\"\n");
  write("b/y.hpp", "#pragma once\n#include \"dsp/a/x.hpp\"\n");
  write("core/error.hpp", "#pragma once\n#include <string>\n");
  CHECK_FALSE(find_cycle(folder_graph(dir.path)).has_value());  // a -> core, b -> a: no cycle
  write("a/detail/z.hpp", "#pragma once\n  #  include <dsp/b/y.hpp>\n");  // a -> b closes a -> b -> a
  const auto cycle = find_cycle(folder_graph(dir.path));
  REQUIRE(cycle.has_value());
  CHECK(*cycle == "a -> b (a/detail/z.hpp:2) -> a (b/y.hpp:2)");
}

}  // namespace dsp::test::include_cycles
