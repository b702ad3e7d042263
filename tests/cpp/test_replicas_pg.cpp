// rank_desync for a LibTorch program (trainsan::compare_replicas over a c10d process group, Note
// [Replica comparison over c10d] in host/replicas_pg.cpp): two ranks, forked from the test, each
// with a c10d::ProcessGroup over one FileStore whose backend is the test's own StoreBackend
// (store_backend.h: the collectives compare_replicas uses, through the store, no gloo), a Linear
// model seeded alike, trainsan::attach and four SGD steps. Each child writes its findings to a
// file and exits; the parent judges them. Also trainsan::ReplicaEngine driven directly, with
// injected steps.
// Nothing touches torch in the parent process (its thread pools would not survive fork()).
#include <gtest/gtest.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "store_backend.h"
#include "trainsan/attach.h"
#include "trainsan/replica_engine.h"
#include "trainsan/replicas.h"

namespace {

// kStopEarly: rank 1 leaves after 2 steps (its process group goes, then its process: the
// collective fails at once); kHang: rank 1 stops after 2 steps but keeps its process group and
// its process for a while (the collective does not complete within desync_timeout).
enum class Scenario { kAgree, kPerturb, kStopEarly, kHang };

constexpr double kTimeoutS = 2.0;  // desync_timeout
constexpr int kSteps = 4;

std::string temp_path(const char* tag) {
  std::string p = ::testing::TempDir() + "trainsan_" + tag + "_XXXXXX";
  std::vector<char> buf(p.begin(), p.end());
  buf.push_back('\0');
  const int fd = mkstemp(buf.data());
  if (fd >= 0) close(fd);
  return buf.data();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One rank's training; its findings ("kind|tensor|message" lines, then "seconds <s>") go to `out`.
void train_rank(int rank, const std::string& store_path, Scenario sc, const std::string& out) {
  at::set_num_threads(1);
  auto pg =
      trainsan_test::store_group(c10::make_intrusive<c10d::FileStore>(store_path, 2), rank, 2);
  torch::manual_seed(0);
  torch::nn::Linear model(4, 3);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Options o;
  o.policy = "record";
  o.desync_timeout = kTimeoutS;
  o.desync_state_every = 2;  // gradients compared at steps 0 and 2
  auto san = trainsan::attach(model, opt, o);
  trainsan::compare_replicas(san, pg);
  torch::manual_seed(1);
  const auto x = torch::randn({8, 4});
  const auto y = torch::randn({8, 3});
  const auto t0 = std::chrono::steady_clock::now();
  const bool early = (sc == Scenario::kStopEarly || sc == Scenario::kHang) && rank == 1;
  const int steps = early ? 2 : kSteps;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = torch::mse_loss(model(x), y);
    loss.backward();
    opt.step();
    san.end_step(loss);
    if (sc == Scenario::kPerturb && rank == 1 && s == 1) {
      torch::NoGradGuard no_grad;
      model->weight.index({0, 0}).add_(1e-3);
    }
  }
  san.close();
  const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ofstream f(out);
  for (const auto& fd : san.findings())
    f << fd.kind << "|" << fd.tensor << "|" << fd.message << "\n";
  f << "seconds " << spent << "\n";
  f.close();
  if (sc == Scenario::kHang && rank == 1) {
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeoutS + 2.0));
  }
}

// Runs `fn` in a forked child (exit status 0: returned, 3: threw, its message in `err`).
int in_child(const std::function<void()>& fn, const std::string& err) {
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      std::ofstream(err) << e.what();
      code = 3;
    }
    std::_Exit(code);  // never back into the test runner (nor its exit handlers)
  }
  return pid;
}

// Waits for the child `pid`, killed if still running at `deadline`; its wait status.
int wait_child(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  int st = 0;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return st;
}

struct Outcome {
  std::vector<int> status;
  std::vector<std::string> out;
};

// Both ranks of `sc`, each in its own process, killed if still running after 60 s.
Outcome run_ranks(Scenario sc) {
  const std::string store = temp_path("store");
  std::remove(store.c_str());
  Outcome o;
  std::vector<pid_t> pids;
  std::vector<std::string> outs, errs;
  for (int r = 0; r < 2; ++r) {
    outs.push_back(temp_path("out"));
    errs.push_back(temp_path("err"));
    pids.push_back(in_child([&, r] { train_rank(r, store, sc, outs[static_cast<size_t>(r)]); },
                            errs[static_cast<size_t>(r)]));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  o.status.assign(2, -1);
  for (size_t r = 0; r < 2; ++r) {
    const int st = wait_child(pids[r], deadline);
    o.status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 9;
    o.out.push_back(slurp(outs[r]) + slurp(errs[r]));
    std::remove(outs[r].c_str());
    std::remove(errs[r].c_str());
  }
  std::remove(store.c_str());
  return o;
}

std::vector<std::string> desync_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("rank_desync|", 0) == 0) lines.push_back(l);
  }
  return lines;
}

double seconds(const std::string& out) {
  const auto at = out.rfind("seconds ");
  return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 8));
}

TEST(ReplicasPg, IdenticalReplicasAgree) {
  const Outcome o = run_ranks(Scenario::kAgree);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(o.status[r], 0) << "rank " << r << ":\n" << o.out[r];
    EXPECT_TRUE(desync_lines(o.out[r]).empty()) << "rank " << r << ":\n" << o.out[r];
  }
}

TEST(ReplicasPg, PerturbedWeightIsNamed) {
  const Outcome o = run_ranks(Scenario::kPerturb);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(o.status[r], 0) << "rank " << r << ":\n" << o.out[r];
    // The weight rank 1 wrote after step 1 differs at step 2's comparison, on both ranks (its
    // gradients differ there too: a finding of their own).
    std::string weight;
    for (const std::string& l : desync_lines(o.out[r])) {
      if (l.rfind("rank_desync|weight|", 0) == 0) weight = l;
    }
    ASSERT_FALSE(weight.empty()) << "rank " << r << ":\n" << o.out[r];
    EXPECT_NE(weight.find("after step 2"), std::string::npos) << weight;
    EXPECT_NE(weight.find("rank 1 differs from rank 0"), std::string::npos) << weight;
  }
}

TEST(ReplicasPg, RankThatStopsEarlyIsMissing) {
  const Outcome o = run_ranks(Scenario::kStopEarly);
  for (size_t r = 0; r < 2; ++r) ASSERT_EQ(o.status[r], 0) << "rank " << r << ":\n" << o.out[r];
  EXPECT_TRUE(desync_lines(o.out[1]).empty()) << o.out[1];
  const auto lines = desync_lines(o.out[0]);
  ASSERT_EQ(lines.size(), 1u) << o.out[0];
  EXPECT_NE(lines[0].find("rank 1 of "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("did not arrive at the replica comparison of step 2"), std::string::npos)
      << lines[0];
  // The collective failed (Work::wait threw) as soon as rank 1's process group was gone.
  EXPECT_NE(lines[0].find("the comparison failed: "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("rank 1 left the group"), std::string::npos) << lines[0];
  // Within desync_timeout (and the training went on): never a hang.
  EXPECT_LT(seconds(o.out[0]), kTimeoutS + 5.0) << o.out[0];
}

TEST(ReplicasPg, RankThatHangsIsMissingAfterTheTimeout) {
  const Outcome o = run_ranks(Scenario::kHang);
  for (size_t r = 0; r < 2; ++r) ASSERT_EQ(o.status[r], 0) << "rank " << r << ":\n" << o.out[r];
  const auto lines = desync_lines(o.out[0]);
  ASSERT_EQ(lines.size(), 1u) << o.out[0];
  EXPECT_NE(lines[0].find("did not arrive at the replica comparison of step 2"), std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("within 2"), std::string::npos) << lines[0];
  // Rank 0 waited desync_timeout once, then trained on without comparing.
  EXPECT_GE(seconds(o.out[0]), kTimeoutS) << o.out[0];
  EXPECT_LT(seconds(o.out[0]), kTimeoutS + 5.0) << o.out[0];
}

// trainsan::ReplicaEngine driven directly, with its steps injected (the way the Python package
// drives it: Note [Replica comparison over c10d]): rank 1's fingerprint differs at the first
// comparison, where the rows step answers instead of an all-gather; then rank 1 launches no more,
// and rank 0's gone step says so at once, its missing step naming the rank. "ok" or what failed
// goes to `out`.
void engine_rank(int rank, const std::string& store_path, const std::string& out) {
  at::set_num_threads(1);
  auto pg =
      trainsan_test::store_group(c10::make_intrusive<c10d::FileStore>(store_path, 2), rank, 2);
  trainsan::ReplicaSetSpec spec;
  spec.context = "the test's set";
  spec.ranks = {10, 11};
  spec.rank = 10 + rank;
  spec.members = {0};
  spec.member_names = {"w"};
  spec.digest = 7;
  spec.timeout_s = kTimeoutS;
  spec.collective_timeout = std::chrono::milliseconds(10000);
  std::vector<trainsan::ReplicaReport> reports;
  int rows_asked = 0;
  std::vector<int64_t> missing_asked;
  trainsan::ReplicaSteps steps;
  steps.report = [&](const trainsan::ReplicaReport& r) { reports.push_back(r); };
  steps.rows = [&](int64_t, const std::vector<int64_t>& row, const std::vector<int64_t>& fields) {
    ++rows_asked;
    std::vector<std::vector<int64_t>> rows(2);
    for (const int64_t f : fields) {
      rows[0].push_back(row.at(static_cast<size_t>(f)));
      rows[1].push_back(row.at(static_cast<size_t>(f)) + 1);  // member 11 holds another value
    }
    return std::optional<std::vector<std::vector<int64_t>>>(rows);
  };
  steps.gone = [](int64_t seq) { return seq >= 1; };
  steps.missing = [&](int64_t seq, bool timed_out) {
    missing_asked.push_back(timed_out ? -seq : seq);
    return trainsan::ReplicaMissing{{11}, {"rank 11 said so"}};
  };
  trainsan::ReplicaEngine engine(pg, spec, steps);
  auto facts = [&](int64_t step, int64_t fingerprint) {
    trainsan::ReplicaRowFacts f;
    f.opt = 0;
    f.count = step;
    f.step = step;
    f.fingerprints.step = step;
    f.fingerprints.opt = 0;
    f.fingerprints.index = {0};
    f.fingerprints.param = {fingerprint};
    f.fingerprints.grad = {0};
    f.fingerprints.has_grad = {false};
    return f;
  };
  std::ostringstream err;
  engine.launch(facts(0, rank == 1 ? 2 : 1));
  engine.drain(0);
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // alive, never at step 1
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    engine.launch(facts(1, 1));
    engine.drain(0);
    const double spent =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (spent >= kTimeoutS) err << "waited " << spent << " s; ";
    if (!engine.stopped()) err << "not stopped; ";
    if (missing_asked != std::vector<int64_t>{1}) err << "missing step not asked for seq 1; ";
  }
  if (rows_asked != 1) err << "rows step asked " << rows_asked << " times; ";
  const size_t want = rank == 0 ? 2 : 1;
  if (reports.size() != want) err << reports.size() << " reports; ";
  if (!reports.empty()) {
    const trainsan::ReplicaReport& r = reports[0];
    if (r.ranks != std::vector<int64_t>{10, 11} || r.mismatches.size() != 1 ||
        r.mismatches[0].tensor != "w" || r.mismatches[0].labels != std::vector<int64_t>{0, 1}) {
      err << "first report is not w with labels 0, 1; ";
    }
  }
  if (rank == 0 && reports.size() == 2) {
    const trainsan::ReplicaReport& r = reports[1];
    if (r.moment != trainsan::ReplicaReport::Moment::kMissing || r.step != 1 ||
        r.missing != std::vector<int64_t>{11} || r.missing_detail.empty() ||
        r.missing_detail[0] != "rank 11 said so" || r.waited_s != 0.0) {
      err << "second report is not rank 11 missing at step 1; ";
    }
  }
  std::ofstream(out) << (err.str().empty() ? "ok" : err.str());
}

TEST(ReplicaEngine, InjectedStepsReplaceTheC10dOnes) {
  const std::string store = temp_path("store");
  std::remove(store.c_str());
  std::vector<pid_t> pids;
  std::vector<std::string> outs, errs;
  for (int r = 0; r < 2; ++r) {
    outs.push_back(temp_path("out"));
    errs.push_back(temp_path("err"));
    pids.push_back(in_child([&, r] { engine_rank(r, store, outs[static_cast<size_t>(r)]); },
                            errs[static_cast<size_t>(r)]));
  }
  for (size_t r = 0; r < 2; ++r) {
    const int st = wait_child(pids[r], std::chrono::steady_clock::now() + std::chrono::seconds(60));
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << ": " << slurp(errs[r]);
    EXPECT_EQ(slurp(outs[r]), "ok") << "rank " << r << ": " << slurp(errs[r]);
    std::remove(outs[r].c_str());
    std::remove(errs[r].c_str());
  }
  std::remove(store.c_str());
}

TEST(ReplicasPg, ClearErrors) {
  const std::string err = temp_path("err");
  const int pid = in_child(
      [] {
        torch::nn::Linear model(2, 2);
        trainsan::Options o;
        o.policy = "record";
        auto san = trainsan::attach(model, o);
        try {
          trainsan::compare_replicas(san, {});
          std::_Exit(10);
        } catch (const c10::ValueError& e) {
          if (std::string(e.what()).find("process group is null") == std::string::npos) {
            std::_Exit(11);
          }
        }
        auto store = c10::make_intrusive<c10d::HashStore>();
        auto one = c10::make_intrusive<c10d::ProcessGroup>(store, 0, 1);
        try {
          trainsan::compare_replicas(san, one);
          std::_Exit(12);
        } catch (const c10::ValueError& e) {
          if (std::string(e.what()).find("at least 2 ranks") == std::string::npos) {
            std::_Exit(13);
          }
        }
      },
      err);
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
      << "status " << (WIFEXITED(st) ? WEXITSTATUS(st) : -1) << " " << slurp(err);
  std::remove(err.c_str());
}

}  // namespace
