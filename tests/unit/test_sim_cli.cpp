// `brigade simulate` end to end: the printed metrics, the files it writes, and the one-line
// refusals for bad flags and inputs.
#include <brigade/io/trace.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "test_util.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

using brigade::test::rel;

namespace fs = std::filesystem;

namespace {

struct Run {
  int status = -1;
  std::string output;  // stdout and stderr together
};

Run brigade_cli(const std::string& args) {
  const auto r = brigade::test::run_cli(args);
  return {r.rc, r.out + r.err};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One directory per process, removed when the test binary exits.
fs::path scratch(const std::string& name) {
  static const brigade::test::TempDir dir("brigade_test_sim_cli");
  return dir / name;
}

bool have_cli() { return std::string(BRIGADE_CLI).size() > 0 && fs::exists(BRIGADE_CLI); }

}  // namespace

TEST_CASE("sim.cli.1f1b.p4.m8: prints the closed-form bubble and writes trace svg metrics") {
  if (!have_cli()) return;
  const auto trace = scratch("t.json"), svg = scratch("t.svg"), metrics = scratch("m.json");
  const Run r = brigade_cli(
      "simulate --schedule 1f1b --ranks 4 --microbatches 8 --unit-costs 1,2 "
      "--trace " +
      trace.string() + " --svg " + svg.string() + " --metrics " + metrics.string());
  CAPTURE(r.output);
  CHECK(r.status == 0);
  CHECK(contains(r.output, "makespan     33 s"));
  CHECK(contains(r.output, "bubble       0.272727"));  // 3 / 11
  CHECK(contains(r.output, "peak stash   4 3 2 1"));
  const auto j = nlohmann::json::parse(slurp(metrics));
  CHECK(j["bubble_ratio"].get<double>() == rel(3.0 / 11.0));
  CHECK(j["schedule"] == "1f1b");
  CHECK(j["costs"]["kind"] == "unit");
  CHECK(j["peak_stash"][0] == 4);
  CHECK(nlohmann::json::parse(slurp(trace))["traceEvents"].size() > 60);
  CHECK(contains(slurp(svg), "<svg"));
}

TEST_CASE("sim.cli.interleaved-and-model: V and a named model size") {
  if (!have_cli()) return;
  const Run r = brigade_cli(
      "simulate --schedule interleaved-1f1b --ranks 2 --microbatches 4 "
      "--virtual 2 --unit-costs 1,2");
  CAPTURE(r.output);
  CHECK(r.status == 0);
  CHECK(contains(r.output, "bubble       0.111111"));  // 1 / (2*4 + 1)
  const Run m = brigade_cli("simulate --schedule zb-h1 --ranks 4 --microbatches 8 --model 110M");
  CAPTURE(m.output);
  CHECK(m.status == 0);
  CHECK(contains(m.output, "roofline, model 110M"));
  CHECK(contains(m.output, "bytes per rank (stashes + messages held + receive/send windows)"));
  const Run inf =
      brigade_cli("simulate --schedule inference --ranks 2 --microbatches 2 --model 260K");
  CAPTURE(inf.output);
  CHECK(inf.status == 0);
  CHECK(contains(inf.output, "rounds=4 (inference mode)"));
}

TEST_CASE("sim.cli.v-shapes: zb-v and dualpipe-v take V = 2 by default") {
  if (!have_cli()) return;
  const Run z = brigade_cli("simulate --schedule zb-v --ranks 4 --microbatches 8 --unit-costs 2,2,2");
  CAPTURE(z.output);
  CHECK(z.status == 0);
  CHECK(contains(z.output, "zb-v: P=4 M=8 V=2 stages=8"));
  CHECK(contains(z.output, "makespan     51 s"));  // 6M + P - 1 chunk units
  CHECK(contains(z.output, "peak stash   8 8 8 8"));
  const Run d =
      brigade_cli("simulate --schedule dualpipe-v --ranks 4 --microbatches 8 --unit-costs 2,2,2");
  CAPTURE(d.output);
  CHECK(d.status == 0);
  CHECK(contains(d.output, "dualpipe-v: P=4 M=8 V=2 stages=8"));
  CHECK(contains(d.output, "peak stash   9 9 9 9"));  // PP + 1 chunks
}

TEST_CASE("sim.cli.schedule-file: reads validates and rejects a deadlocking file") {
  if (!have_cli()) return;
  const auto good = scratch("good.txt");
  brigade::io::write_file_atomic(good,
                                 "shape ranks=2 microbatches=2\n"
                                 "rank 0: 0F0 0F1 0B0 0B1\n"
                                 "rank 1: 1F0 1B0 1F1 1B1\n");
  const Run ok = brigade_cli("simulate --schedule-file " + good.string() + " --unit-costs 1,1");
  CAPTURE(ok.output);
  CHECK(ok.status == 0);
  CHECK(contains(ok.output, "bubble       0.333333"));
  const auto bad = scratch("bad.txt");
  brigade::io::write_file_atomic(bad,
                                 "shape ranks=2 microbatches=2\n"
                                 "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1\n"
                                 "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n");
  const Run dead = brigade_cli("simulate --schedule-file " + bad.string());
  CAPTURE(dead.output);
  CHECK(dead.status == 2);
  CHECK(contains(dead.output, "brigade: error (Deadlock): validate: deadlock: wait-for cycle"));
  const auto typo = scratch("typo.txt");
  brigade::io::write_file_atomic(typo, "shape ranks=1 microbatches=1\nrank 0: 0F0 0Q0\n");
  const Run t = brigade_cli("simulate --schedule-file " + typo.string());
  CHECK(t.status == 2);
  CHECK(contains(t.output,
                 "typo.txt: schedule text, line 2, column 14: action '0Q0': unknown op 'Q'"));
}

TEST_CASE("sim.cli.errors: bad flags and inputs give one line and a non-zero exit") {
  if (!have_cli()) return;
  struct Bad {
    const char* args;
    const char* needle;
  };
  const Bad cases[] = {
      {"simulate --schedule pipedream", "unknown schedule 'pipedream'"},
      {"simulate --ranks 0", "--ranks: 0 is out of range; expected a whole number from 1 to 4096"},
      {"simulate --schedule dualpipe-v --ranks 4 --microbatches 6",
       "dualpipe-v: microbatches = 6, expected at least 2 x ranks = 8"},
      {"simulate --schedule zb-v --ranks 2 --microbatches 4 --virtual 3",
       "zb-v: virtual stages per rank = 3"},
      {"simulate --unit-costs 1", "--unit-costs '1': 1 values, expected F,B or F,B,W"},
      {"simulate --unit-costs 1,x", "'x' is not a non-negative number"},
      {"simulate --model 7B", "unknown model size '7B'"},
      {"simulate --model 260K --ranks 8", "partition::uniform: 8 stages for 5 decoder layers"},
      {"simulate --model /nonexistent/cfg.json", "/nonexistent/cfg.json: model config not found (no such file)"},
      {"simulate --schedule-file /nonexistent/s.txt", "/nonexistent/s.txt: schedule file not found (no such file)"},
      {"simulate --model 110M --unit-costs 1,2", "excludes"},
      {"simulate --schedule-file x --ranks 2", "excludes"},
  };
  for (const auto& b : cases) {
    const Run r = brigade_cli(b.args);
    CAPTURE(b.args);
    CAPTURE(r.output);
    CHECK(r.status != 0);
    CHECK(contains(r.output, b.needle));
  }
}

TEST_CASE("io.write_file_atomic: errors name the file asked for, not its temporary") {
  const auto folder = scratch("no-such-folder");
  fs::remove_all(folder);
  const auto target = folder / "x.svg";
  CHECK_THROWS_WITH_AS(brigade::io::write_file_atomic(target, "x"),
                       (target.string() + ": cannot write: folder " + folder.string() +
                        " does not exist")
                           .c_str(),
                       brigade::Error);
  CHECK_FALSE(fs::exists(folder));
  // A folder in the place of the file: the open fails, and the message names the file.
  fs::create_directories(folder / "x.svg.tmp");
  CHECK_THROWS_WITH_AS(brigade::io::write_file_atomic(target, "x"),
                       (target.string() + ": cannot open for writing").c_str(), brigade::Error);
  CHECK_FALSE(fs::exists(target));
  fs::remove_all(folder);
}
