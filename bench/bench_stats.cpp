// Benchmarks of the CPU backend of the fused statistics pass (kernels/stats_cpu.cpp chunk loop,
// host/stats.cpp driver) on three float32 workloads, each against named baselines measured in the
// same run:
//   trainsan             trainsan::tensor_stats, the public call (descriptors, pass, unpacking)
//   torch_ops            the same thirteen statistics with torch ops, one tensor at a time, hash
//                        exactly as Note [Hash] (kernels/stats.cuh) in int64 ops; checked bit for
//                        bit against trainsan before the benchmarks run
//   torch_ops_cheap_hash the same with a cheaper, weaker fingerprint (see CheapHash below): a lower
//                        bound on what a torch-ops user would pay
//   foreach_norm         at::_foreach_norm alone (L2 norms only)
//   read_bw              one parallel, vectorised float32 sum over the same bytes: the machine's
//                        single-pass read bandwidth; at_sum (at::sum) on the 64M tensor as a check
// After the runs a summary prints GB/s, ratios against the baselines and the goals of
// bench/README.md. The workloads are cached across benchmarks and built from fixed seeds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "trainsan/stats.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Workloads

struct Workload {
  const char* name;
  std::vector<at::Tensor> tensors;
  int64_t numel = 0;
  int64_t bytes = 0;
};

enum WorkloadId { kParams = 0, kBig = 1, kMany = 2, kNumWorkloads = 3 };
constexpr const char* kWorkloadNames[kNumWorkloads] = {"params", "big64M", "many10k"};

void add(Workload& w, at::Tensor t) {
  w.numel += t.numel();
  w.bytes += t.numel() * static_cast<int64_t>(t.element_size());
  w.tensors.push_back(std::move(t));
}

// (a) The parameters of a GPT-style decoder (d_model 256, 16 layers, vocabulary 12288, context
// 1024) with an MLP head 256 -> 1024 -> 10: 200 float32 tensors, 16.3M elements, from 10-element
// biases to a 3.1M-element embedding, each its own allocation as in a real model.
Workload make_params() {
  at::manual_seed(1);
  Workload w;
  w.name = kWorkloadNames[0];
  const int64_t d = 256, layers = 16, vocab = 12288, ctx = 1024;
  auto weight = [](std::vector<int64_t> s) { return at::randn(s).mul_(0.02); };
  auto bias = [](int64_t n) { return at::randn({n}).mul_(0.01); };
  auto norm_weight = [](int64_t n) { return at::randn({n}).mul_(0.1).add_(1.0); };
  add(w, weight({vocab, d}));
  add(w, weight({ctx, d}));
  for (int64_t l = 0; l < layers; ++l) {
    add(w, norm_weight(d));
    add(w, bias(d));
    add(w, weight({3 * d, d}));
    add(w, bias(3 * d));
    add(w, weight({d, d}));
    add(w, bias(d));
    add(w, norm_weight(d));
    add(w, bias(d));
    add(w, weight({4 * d, d}));
    add(w, bias(4 * d));
    add(w, weight({d, 4 * d}));
    add(w, bias(d));
  }
  add(w, norm_weight(d));
  add(w, bias(d));
  add(w, weight({1024, d}));
  add(w, bias(1024));
  add(w, weight({10, 1024}));
  add(w, bias(10));
  return w;
}

// (b) One 64M-element (256 MiB) float32 tensor.
Workload make_big() {
  at::manual_seed(2);
  Workload w;
  w.name = kWorkloadNames[1];
  add(w, at::randn({int64_t{64} << 20}));
  return w;
}

// (c) 10,000 float32 tensors of 1,000 elements.
Workload make_many() {
  at::manual_seed(3);
  Workload w;
  w.name = kWorkloadNames[2];
  for (int i = 0; i < 10000; ++i) add(w, at::randn({1000}));
  return w;
}

const Workload& workload(int id) {
  static Workload cache[kNumWorkloads];
  static bool built[kNumWorkloads] = {};
  if (!built[id]) {
    cache[id] = id == kParams ? make_params() : id == kBig ? make_big() : make_many();
    built[id] = true;
  }
  return cache[id];
}

// ---------------------------------------------------------------------------------------------
// The torch-ops equivalent

// Note [Hash] of kernels/stats.cuh in int64 torch ops: int64 multiplication and summation wrap
// mod 2^64 like uint64, and a logical right shift is an arithmetic one with the sign bits masked.
constexpr int64_t kIndexMul = static_cast<int64_t>(0x9e3779b97f4a7c15ull);
constexpr int64_t kMix1 = static_cast<int64_t>(0xff51afd7ed558ccdull);
constexpr int64_t kMix2 = static_cast<int64_t>(0xc4ceb9fe1a85ec53ull);

void mix64_(at::Tensor& h) {
  const int64_t low31 = (int64_t{1} << 31) - 1;  // clears what the arithmetic shift copied in
  h.bitwise_xor_(h.bitwise_right_shift(33).bitwise_and_(low31));
  h.mul_(kMix1);
  h.bitwise_xor_(h.bitwise_right_shift(33).bitwise_and_(low31));
  h.mul_(kMix2);
  h.bitwise_xor_(h.bitwise_right_shift(33).bitwise_and_(low31));
}

uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// The element bits of a float tensor in logical order, zero-extended to int64.
at::Tensor bits_int64(const at::Tensor& x) {
  const at::Tensor c = x.contiguous().view(-1);
  switch (x.element_size()) {
    case 2:
      return c.view(at::kShort).to(at::kLong).bitwise_and_(0xffff);
    case 4:
      return c.view(at::kInt).to(at::kLong).bitwise_and_(0xffffffffLL);
    default:
      return c.view(at::kLong).clone();
  }
}

// Exact fingerprint sum S = sum_i mix64(b_i + i * kIndexMul), as an int64 0-d tensor.
at::Tensor exact_hash_sum(const at::Tensor& x) {
  at::Tensor h = bits_int64(x);
  h.add_(at::arange(x.numel(), at::kLong).mul_(kIndexMul));
  mix64_(h);
  return h.sum();
}

// CheapHash: S = sum_i b_i * (2i + 1) mod 2^64, a position-weighted sum of the bits. One multiply
// per element instead of mix64's five operations, but linear: many pairs of changes cancel, so it
// is a weaker fingerprint than Note [Hash]; used only to bound the torch cost from below.
at::Tensor cheap_hash_sum(const at::Tensor& x) {
  at::Tensor h = bits_int64(x);
  h.mul_(at::arange(x.numel(), at::kLong).mul_(2).add_(1));
  return h.sum();
}

// The thirteen statistics of one float tensor with torch ops, in the packed layout of
// trainsan::PackedStats: ints [numel nan posinf neginf zero subnormal fp16_overflow hash-sum],
// floats [min max absmax sum sumsq]. Masked with where() rather than boolean indexing so that it
// has no data-dependent shapes (on a GPU, no synchronisation per tensor).
void torch_stats_one(const at::Tensor& x, bool exact_hash, std::vector<at::Tensor>& ints,
                     std::vector<at::Tensor>& floats) {
  const double inf = std::numeric_limits<double>::infinity();
  const double tiny = x.scalar_type() == at::kFloat    ? std::numeric_limits<float>::min()
                      : x.scalar_type() == at::kDouble ? std::numeric_limits<double>::min()
                      : x.scalar_type() == at::kHalf   ? 6.103515625e-05
                                                       : 1.1754943508222875e-38;  // bfloat16
  const at::Tensor fin = x.isfinite();
  const at::Tensor xf = at::where(fin, x, 0);  // finite values, 0 in place of NaN/Inf
  const at::Tensor a = xf.abs();
  ints.push_back(x.isnan().sum());
  ints.push_back(x.isposinf().sum());
  ints.push_back(x.isneginf().sum());
  ints.push_back(x.eq(0).sum());
  ints.push_back(a.lt(tiny).logical_and_(a.gt(0)).sum());
  ints.push_back(a.gt(65504).sum());
  ints.push_back(exact_hash ? exact_hash_sum(x) : cheap_hash_sum(x));
  floats.push_back(at::where(fin, x, inf).min().to(at::kDouble));
  floats.push_back(at::where(fin, x, -inf).max().to(at::kDouble));
  floats.push_back(a.max().to(at::kDouble));
  const at::Tensor xd = xf.to(at::kDouble).view(-1);
  floats.push_back(xd.sum());
  floats.push_back(at::dot(xd, xd));
}

// All tensors: per-tensor ops, results stacked and read once, hash finalized on the host.
trainsan::PackedStats torch_stats(const std::vector<at::Tensor>& tensors, bool exact_hash) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<at::Tensor> ints, floats;
  ints.reserve(tensors.size() * 7);
  floats.reserve(tensors.size() * 5);
  for (const at::Tensor& t : tensors) torch_stats_one(t, exact_hash, ints, floats);
  at::Tensor ri = at::stack(ints).view({n, 7});
  at::Tensor rf = at::stack(floats).view({n, 5});
  at::Tensor out_i = at::empty({n, 8}, at::kLong);
  at::Tensor out_f = at::empty({n, 5}, at::kDouble);
  const int64_t* pi = ri.const_data_ptr<int64_t>();
  const double* pf = rf.const_data_ptr<double>();
  int64_t* oi = out_i.mutable_data_ptr<int64_t>();
  double* of = out_f.mutable_data_ptr<double>();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t numel = tensors[k].numel();
    const int64_t* r = pi + k * 7;
    oi[k * 8] = numel;
    std::copy(r, r + 6, oi + k * 8 + 1);
    const uint64_t s = static_cast<uint64_t>(r[6]);
    oi[k * 8 + 7] = static_cast<int64_t>(exact_hash ? mix64(s ^ static_cast<uint64_t>(numel))
                                                    : s ^ static_cast<uint64_t>(numel));
    const bool any_finite = numel - r[0] - r[1] - r[2] > 0;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (int j = 0; j < 3; ++j) of[k * 5 + j] = any_finite ? pf[k * 5 + j] : nan;
    of[k * 5 + 3] = pf[k * 5 + 3];
    of[k * 5 + 4] = std::sqrt(pf[k * 5 + 4]);
  }
  return {out_i, out_f};
}

// ---------------------------------------------------------------------------------------------
// Single-pass read bandwidth: the same bytes cut into 64K-element spans, summed in parallel with
// a 32-lane float32 accumulator that the compiler vectorises.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BENCH_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BENCH_CLONES
#endif

BENCH_CLONES float sum_span(const float* p, int64_t n) {
  constexpr int kLanes = 32;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += p[i + l];
  }
  float s = 0;
  for (; i < n; ++i) s += p[i];
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

struct Span {
  const float* p;
  int64_t n;
};

std::vector<Span> spans_of(const Workload& w) {
  constexpr int64_t kSpan = int64_t{1} << 16;
  std::vector<Span> spans;
  for (const at::Tensor& t : w.tensors) {
    const float* p = t.const_data_ptr<float>();
    for (int64_t s = 0; s < t.numel(); s += kSpan)
      spans.push_back({p + s, std::min(kSpan, t.numel() - s)});
  }
  return spans;
}

double read_all(const std::vector<Span>& spans) {
  std::vector<double> partial(spans.size());
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) partial[k] = sum_span(spans[k].p, spans[k].n);
  });
  double s = 0;
  for (double v : partial) s += v;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Benchmarks

void set_rates(benchmark::State& state, const Workload& w) {
  state.SetBytesProcessed(state.iterations() * w.bytes);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(w.bytes),
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tensors"] = static_cast<double>(w.tensors.size());
  state.counters["Melems"] = static_cast<double>(w.numel) / 1e6;
  state.counters["threads"] = at::get_num_threads();
}

void bm_trainsan(benchmark::State& state, int id) {
  const Workload& w = workload(id);
  for (auto _ : state) {
    std::vector<trainsan::TensorStats> s = trainsan::tensor_stats(w.tensors);
    benchmark::DoNotOptimize(s.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, w);
}

void bm_torch_ops(benchmark::State& state, int id, bool exact_hash) {
  const Workload& w = workload(id);
  for (auto _ : state) {
    trainsan::PackedStats s = torch_stats(w.tensors, exact_hash);
    benchmark::DoNotOptimize(s.ints.const_data_ptr());
    benchmark::ClobberMemory();
  }
  set_rates(state, w);
}

void bm_foreach_norm(benchmark::State& state, int id) {
  const Workload& w = workload(id);
  for (auto _ : state) {
    std::vector<at::Tensor> norms = at::_foreach_norm(w.tensors, 2);
    benchmark::DoNotOptimize(norms.data());
    benchmark::ClobberMemory();
  }
  set_rates(state, w);
}

void bm_read_bw(benchmark::State& state, int id) {
  const Workload& w = workload(id);
  const std::vector<Span> spans = spans_of(w);
  for (auto _ : state) benchmark::DoNotOptimize(read_all(spans));
  set_rates(state, w);
}

void bm_at_sum(benchmark::State& state, int id) {
  const Workload& w = workload(id);
  for (auto _ : state) {
    at::Tensor s = at::sum(w.tensors[0]);
    benchmark::DoNotOptimize(s.const_data_ptr());
  }
  set_rates(state, w);
}

void bm_trainsan_1thread(benchmark::State& state, int id) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  bm_trainsan(state, id);
  at::set_num_threads(threads);
  state.counters["threads"] = 1;
}

void bm_read_bw_1thread(benchmark::State& state, int id) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  bm_read_bw(state, id);
  at::set_num_threads(threads);
  state.counters["threads"] = 1;
}

// ---------------------------------------------------------------------------------------------
// Correctness: trainsan against the torch-ops equivalent (float64 sums) before anything is timed.

// The parameter workload with non-finite, zero, subnormal and beyond-fp16 values at the first,
// last and chunk-boundary (65536) indices of some tensors, and one tensor with no finite element.
std::vector<at::Tensor> with_specials(const Workload& w) {
  std::vector<at::Tensor> out;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t k = 0; k < w.tensors.size(); ++k) {
    at::Tensor t = w.tensors[k].clone();
    at::Tensor f = t.view(-1);
    const int64_t n = f.numel();
    if (k % 3 == 0) {
      f[0] = nan;
      f[n - 1] = inf;
      if (n > 65536) f[65536] = -inf;
      if (n > 65535) f[65535] = 1e-40f;  // subnormal
      f[n / 2] = 0.0f;
      f[n / 3] = -70000.0f;  // beyond fp16
    }
    if (k == 7) t.fill_(nan);
    out.push_back(t);
  }
  return out;
}

bool same_stats(const char* label, const std::vector<at::Tensor>& tensors) {
  const trainsan::PackedStats a = trainsan::tensor_stats_packed(tensors);
  const trainsan::PackedStats b = torch_stats(tensors, /*exact_hash=*/true);
  const int64_t* ai = a.ints.const_data_ptr<int64_t>();
  const int64_t* bi = b.ints.const_data_ptr<int64_t>();
  const double* af = a.floats.const_data_ptr<double>();
  const double* bf = b.floats.const_data_ptr<double>();
  const char* kInt[] = {"numel", "nan",       "posinf",        "neginf",
                        "zero",  "subnormal", "fp16_overflow", "hash"};
  const char* kFloat[] = {"min", "max", "absmax", "sum", "l2"};
  double worst = 0;
  bool ok = true;
  for (size_t k = 0; k < tensors.size() && ok; ++k) {
    for (int j = 0; j < 8 && ok; ++j) {
      if (ai[k * 8 + j] != bi[k * 8 + j]) {
        std::fprintf(stderr, "verify %s: tensor %zu %s: trainsan %lld, torch %lld\n", label, k,
                     kInt[j], static_cast<long long>(ai[k * 8 + j]),
                     static_cast<long long>(bi[k * 8 + j]));
        ok = false;
      }
    }
    // min/max/absmax are exact; sum and l2 differ only by float64 rounding order: bounded by
    // n * eps * sum|x| <= n * eps * sqrt(n) * l2.
    const double n = static_cast<double>(tensors[k].numel());
    const double l2 = bf[k * 5 + 4];
    for (int j = 0; j < 5 && ok; ++j) {
      const double x = af[k * 5 + j], y = bf[k * 5 + j];
      const double tol = j < 3 ? 0.0 : 1e-13 * n * std::sqrt(n) * l2;
      const bool both_nan = std::isnan(x) && std::isnan(y);
      if (!both_nan && !(std::fabs(x - y) <= tol)) {
        std::fprintf(stderr, "verify %s: tensor %zu %s: trainsan %.17g, torch %.17g\n", label, k,
                     kFloat[j], x, y);
        ok = false;
      }
      if (j >= 3 && y != 0) worst = std::max(worst, std::fabs(x - y) / std::fabs(y));
    }
  }
  std::printf(
      "verify %-16s %5zu tensors: %s (integers and hash exact, min/max/absmax exact, "
      "largest relative sum/l2 difference %.1e)\n",
      label, tensors.size(), ok ? "ok" : "MISMATCH", worst);
  return ok;
}

bool verify() {
  bool ok = true;
  for (int id = 0; id < kNumWorkloads; ++id)
    ok &= same_stats(kWorkloadNames[id], workload(id).tensors);
  ok &= same_stats("params+specials", with_specials(workload(kParams)));
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Summary: per-iteration real time of every benchmark (the median over repetitions), ratios
// against the baselines of the same run, and the goals.

class SummaryReporter : public benchmark::BenchmarkReporter {
 public:
  explicit SummaryReporter(benchmark::BenchmarkReporter* inner) : inner_(inner) {}
  bool ReportContext(const Context& context) override { return inner_->ReportContext(context); }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred || r.iterations == 0) continue;
      const double sec = r.real_accumulated_time / static_cast<double>(r.iterations);
      const std::string name = r.run_name.function_name;
      if (r.run_type == Run::RT_Aggregate) {
        if (r.aggregate_name == "median") median_[name] = sec;
      } else {
        samples_[name].push_back(sec);
      }
    }
    inner_->ReportRuns(runs);
  }
  void Finalize() override { inner_->Finalize(); }

  // Seconds per iteration, or a negative number when the benchmark did not run.
  double seconds(const std::string& name) const {
    if (auto it = median_.find(name); it != median_.end()) return it->second;
    auto it = samples_.find(name);
    if (it == samples_.end() || it->second.empty()) return -1;
    std::vector<double> v = it->second;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  }

 private:
  benchmark::BenchmarkReporter* inner_;
  std::map<std::string, double> median_;
  std::map<std::string, std::vector<double>> samples_;
};

std::string bm_name(int id, const char* contender) {
  return std::string("stats/") + kWorkloadNames[id] + "/" + contender;
}

void print_summary(const SummaryReporter& rep) {
  auto sec = [&](int id, const char* c) { return rep.seconds(bm_name(id, c)); };
  auto gbs = [&](int id, const char* c) {
    const double s = sec(id, c);
    return s > 0 ? static_cast<double>(workload(id).bytes) / s / 1e9 : -1.0;
  };
  bool any = false;
  for (int id = 0; id < kNumWorkloads; ++id) any |= sec(id, "trainsan") > 0;
  if (!any) return;
  std::printf("\nSummary (median real time per iteration; %d intra-op threads)\n",
              at::get_num_threads());
  std::printf("%-8s | %-22s | %9s | %11s | %s\n", "workload", "contender", "GB/s", "ms/iter",
              "trainsan speed relative to it");
  const char* contenders[] = {"trainsan",     "torch_ops", "torch_ops_cheap_hash",
                              "foreach_norm", "read_bw",   "at_sum"};
  for (int id = 0; id < kNumWorkloads; ++id) {
    const double t0 = sec(id, "trainsan");
    for (const char* c : contenders) {
      const double t = sec(id, c);
      if (t <= 0) continue;
      char rel[64] = "";
      if (t0 > 0 && std::strcmp(c, "trainsan") != 0)
        std::snprintf(rel, sizeof(rel), "%.2fx", t / t0);
      std::printf("%-8s | %-22s | %9.2f | %11.3f | %s\n", kWorkloadNames[id], c, gbs(id, c),
                  t * 1e3, rel);
    }
  }
  std::printf("\nGoals\n");
  auto verdict = [](bool ran, bool met) { return !ran ? "not run" : met ? "MET" : "MISSED"; };
  for (int id = 0; id < kNumWorkloads; ++id) {
    const double t0 = sec(id, "trainsan"), tt = sec(id, "torch_ops"),
                 tc = sec(id, "torch_ops_cheap_hash"), tn = sec(id, "foreach_norm");
    std::printf("%-8s >=20x faster than torch_ops:      %7.1fx (cheap-hash variant %.1fx)  %s\n",
                kWorkloadNames[id], t0 > 0 && tt > 0 ? tt / t0 : 0.0,
                t0 > 0 && tc > 0 ? tc / t0 : 0.0, verdict(t0 > 0 && tt > 0, tt >= 20 * t0));
    std::printf("%-8s within 1.5x of foreach_norm:       %7.2fx the time                  %s\n",
                kWorkloadNames[id], t0 > 0 && tn > 0 ? t0 / tn : 0.0,
                verdict(t0 > 0 && tn > 0, t0 <= 1.5 * tn));
  }
  // The read bandwidth baseline is the faster of the hand-written pass and at::sum.
  const double bw = std::max(gbs(kBig, "read_bw"), gbs(kBig, "at_sum"));
  const double g = gbs(kBig, "trainsan");
  std::printf("%-8s >= half of read bandwidth:        %7.2f of %.2f GB/s = %.0f%%        %s\n",
              kWorkloadNames[kBig], g, bw, bw > 0 ? 100 * g / bw : 0.0,
              verdict(g > 0 && bw > 0, g >= 0.5 * bw));
}

void register_benchmarks() {
  for (int id = 0; id < kNumWorkloads; ++id) {
    auto reg = [&](const char* c, auto fn, int reps) {
      benchmark::RegisterBenchmark(bm_name(id, c).c_str(), fn, id)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond)
          ->Repetitions(reps)
          ->DisplayAggregatesOnly(true);
    };
    reg("trainsan", bm_trainsan, 5);
    reg(
        "torch_ops", [](benchmark::State& s, int i) { bm_torch_ops(s, i, true); }, 3);
    reg(
        "torch_ops_cheap_hash", [](benchmark::State& s, int i) { bm_torch_ops(s, i, false); }, 3);
    reg("foreach_norm", bm_foreach_norm, 5);
    reg("read_bw", bm_read_bw, 5);
    if (id == kBig) {
      reg("at_sum", bm_at_sum, 5);
      reg("trainsan_1thread", bm_trainsan_1thread, 3);
      reg("read_bw_1thread", bm_read_bw_1thread, 3);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // --no_verify skips the correctness check (for profiling); every other flag is Google
  // Benchmark's.
  bool check = true;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no_verify") == 0) {
      check = false;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("bench_stats: %d intra-op threads\n", at::get_num_threads());
  if (check && !verify()) {
    std::fprintf(stderr, "bench_stats: trainsan and the torch-ops equivalent disagree\n");
    return 1;
  }
  register_benchmarks();
  SummaryReporter reporter(benchmark::CreateDefaultDisplayReporter());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_summary(reporter);
  benchmark::Shutdown();
  return 0;
}
