// Facts by name (Note [Facts by name], trainsan/facts_dict.h): the structs' tables to and from
// Dict(str, Any), nested and flattened; unknown, missing and mistyped fields are errors naming the
// struct and the field.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "trainsan/trainsan.h"

namespace {

using trainsan::facts_from_dict;
using trainsan::facts_to_dict;
using trainsan::FactsDict;

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

template <class Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

trainsan::ResumeFacts resume() {
  trainsan::ResumeFacts f;
  f.moment = trainsan::ResumeFacts::Moment::kFirstStep;
  f.opt = 1;
  f.optimizer_type = "AdamW";
  f.dropped_frozen = {"a", "b"};
  f.stateful = true;
  f.lr = 1e-4;
  return f;
}

TEST(FactsDict, RoundTripsByName) {
  const FactsDict d = facts_to_dict(resume());
  EXPECT_EQ(d.at("optimizer_type").toStringRef(), "AdamW");
  EXPECT_EQ(d.at("moment").toInt(), 2);
  const auto back = facts_from_dict<trainsan::ResumeFacts>(d);
  EXPECT_EQ(back.moment, trainsan::ResumeFacts::Moment::kFirstStep);
  EXPECT_EQ(back.opt, 1);
  EXPECT_EQ(back.dropped_frozen, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(back.stateful);
  EXPECT_EQ(back.lr, 1e-4);
  EXPECT_TRUE(std::isnan(back.checkpoint_lr));
  // Records nested (as facts_to_dict writes them) and flattened (as Python sends them).
  trainsan::CheckpointFacts c;
  c.source = "x.pt";
  c.nonfinite = {{"w", 1, 4}, {"b", 2, 2}};
  FactsDict nested = facts_to_dict(c);
  EXPECT_EQ(facts_from_dict<trainsan::CheckpointFacts>(nested).nonfinite[1].count, 2);
  FactsDict flat = facts_to_dict(c);
  flat.insert_or_assign("nonfinite", 1);
  flat.insert("nonfinite.0.key", std::string("w"));
  flat.insert("nonfinite.0.count", int64_t{3});
  flat.insert("nonfinite.0.numel", int64_t{4});
  const auto f = facts_from_dict<trainsan::CheckpointFacts>(flat);
  ASSERT_EQ(f.nonfinite.size(), 1u);
  EXPECT_EQ(f.nonfinite[0].count, 3);
}

TEST(FactsDict, EmptyListsAsNoneAndIntsAsFloats) {
  FactsDict d = facts_to_dict(resume());
  d.insert_or_assign("dropped_frozen", c10::IValue());
  d.insert_or_assign("lr", int64_t{0});
  const auto f = facts_from_dict<trainsan::ResumeFacts>(d);
  EXPECT_TRUE(f.dropped_frozen.empty());
  EXPECT_EQ(f.lr, 0.0);
}

TEST(FactsDict, UnknownMissingAndMistypedFieldsAreNamed) {
  FactsDict d = facts_to_dict(resume());
  d.insert("learning_rate", 0.1);
  std::string e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::ResumeFacts>(d); });
  EXPECT_TRUE(has(e,
                  "ResumeFacts: unknown field 'learning_rate' (the fields of ResumeFacts are "
                  "moment, opt,"))
      << e;
  d = facts_to_dict(resume());
  ASSERT_EQ(d.erase("progress"), 1u);
  e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::ResumeFacts>(d); });
  EXPECT_TRUE(has(e, "ResumeFacts: missing field 'progress' (str)")) << e;
  d = facts_to_dict(resume());
  d.insert_or_assign("lr", std::string("fast"));
  e = error_of<c10::TypeError>([&] { facts_from_dict<trainsan::ResumeFacts>(d); });
  EXPECT_TRUE(has(e, "ResumeFacts.lr: expected float, got str")) << e;
  d.insert_or_assign("lr", 0.1);
  d.insert_or_assign("moment", int64_t{7});  // one past kScheduleStep (3)
  e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::ResumeFacts>(d); });
  EXPECT_TRUE(has(e, "ResumeFacts.moment: 7 is not one of 0..3")) << e;
  d.insert_or_assign("moment", int64_t{0});
  c10::impl::GenericList names(c10::AnyType::get());
  names.push_back(std::string("a"));
  names.push_back(int64_t{3});
  d.insert_or_assign("dropped_frozen", names);
  e = error_of<c10::TypeError>([&] { facts_from_dict<trainsan::ResumeFacts>(d); });
  EXPECT_TRUE(has(e, "ResumeFacts.dropped_frozen[1]: expected str, got int")) << e;
  // In a flattened record list: the record's path.
  FactsDict flat = facts_to_dict(trainsan::CheckpointFacts{});
  flat.insert_or_assign("nonfinite", 1);
  flat.insert("nonfinite.0.key", std::string("w"));
  flat.insert("nonfinite.0.count", 1.5);
  flat.insert("nonfinite.0.numel", int64_t{4});
  e = error_of<c10::TypeError>([&] { facts_from_dict<trainsan::CheckpointFacts>(flat); });
  EXPECT_TRUE(has(e, "CheckpointFacts.nonfinite.0.count: expected int, got float")) << e;
  flat.insert_or_assign("nonfinite.0.count", int64_t{1});
  ASSERT_EQ(flat.erase("nonfinite.0.numel"), 1u);
  e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::CheckpointFacts>(flat); });
  EXPECT_TRUE(has(e, "CheckpointFacts: missing field 'nonfinite.0.numel' (int)")) << e;
}

TEST(FactsDict, TensorsAndNamedTensors) {
  trainsan::OptimizerTensors o;
  o.path = "opt";
  o.params = {{"w", torch::ones({2, 3})}};
  o.state = {{{"step", torch::tensor(4)}, {"extra", at::Tensor()}}};
  const auto back = facts_from_dict<trainsan::OptimizerTensors>(facts_to_dict(o));
  ASSERT_EQ(back.params.size(), 1u);
  EXPECT_TRUE(back.params[0].second.is_same(o.params[0].second));
  ASSERT_EQ(back.state.size(), 1u);
  ASSERT_EQ(back.state[0].size(), 2u);
  EXPECT_FALSE(back.state[0][1].second.defined());  // None: a value that is no tensor
  EXPECT_EQ(trainsan::describe_optimizer(back).slots[0].step, 4);
}

TEST(FactsDict, OptionalRecordsAndNestedLists) {
  trainsan::Provenance p;
  p.forward_checked = 5;
  trainsan::ModuleOrigin o;
  o.module = "attn.qkv";
  o.beyond_fp16 = {{"attn.qkv.weight", 3}};
  o.prior_absmax = 7e4;
  p.forward = o;
  p.fp16_range = {{"mlp", "Linear", "float32", 1e5}};
  FactsDict d = facts_to_dict(p);
  EXPECT_TRUE(d.at("backward").isNone());
  auto back = facts_from_dict<trainsan::Provenance>(d);
  ASSERT_TRUE(back.forward.has_value());
  EXPECT_FALSE(back.backward.has_value());
  EXPECT_EQ(back.forward->beyond_fp16[0].second, 3);
  EXPECT_EQ(back.fp16_range[0].absmax, 1e5);
  // Flattened, as Python sends an optional record: its count (0 or 1) and "forward.0.<field>".
  FactsDict flat = facts_to_dict(p);
  flat.insert_or_assign("forward", int64_t{1});
  const FactsDict origin = facts_to_dict(o);
  for (const auto& kv : origin) flat.insert("forward.0." + kv.key(), kv.value());
  flat.insert_or_assign("forward.0.position", std::string("first"));
  const std::string e =
      error_of<c10::TypeError>([&] { facts_from_dict<trainsan::Provenance>(flat); });
  EXPECT_TRUE(has(e, "Provenance.forward.0.position: expected int, got str")) << e;
  flat.insert_or_assign("forward.0.position", int64_t{2});
  back = facts_from_dict<trainsan::Provenance>(flat);
  EXPECT_EQ(back.forward->position, 2);
  EXPECT_EQ(back.forward->module, "attn.qkv");

  trainsan::ReplicaReport r;
  r.ranks = {0, 1, 2};
  r.mismatches = {{"w", "parameter", {0, 0, 1}}, {"b", "gradient", {}}};
  r.skipped = {false, true, false};
  const auto rb = facts_from_dict<trainsan::ReplicaReport>(facts_to_dict(r));
  EXPECT_EQ(rb.mismatches[0].labels, (std::vector<int64_t>{0, 0, 1}));
  EXPECT_TRUE(rb.mismatches[1].labels.empty());
  EXPECT_EQ(rb.skipped, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(rb.moment, trainsan::ReplicaReport::Moment::kAfterStep);
}

TEST(FactsDict, DefaultsByStructName) {
  const FactsDict d = trainsan::facts_defaults("ResumeFacts");
  EXPECT_EQ(d.at("opt").toInt(), -1);
  trainsan::RerunFacts r;
  r.where = trainsan::RerunFacts::Where::kBetweenCalls;
  r.tensor = "fc1";
  const auto back = facts_from_dict<trainsan::RerunFacts>(facts_to_dict(r));
  EXPECT_EQ(back.where, trainsan::RerunFacts::Where::kBetweenCalls);
  EXPECT_EQ(back.tensor, "fc1");
  EXPECT_TRUE(d.at("dropped_frozen").toListRef().empty());
  const std::string e = error_of<c10::ValueError>([] { trainsan::facts_defaults("Resume"); });
  EXPECT_TRUE(has(e, "no facts struct is named 'Resume'; there are ResumeFacts,")) << e;
}

// The last positional seams, by name: a Finding crosses as a dict (finding.def), and a sanitizer
// is built from one (SanitizerArgs: parameters, options, Setup's table setup.def).
TEST(FactsDict, FindingByName) {
  trainsan::Finding f;
  f.kind = "nonfinite_loss";
  f.step = 3;
  f.severity = "error";
  f.message = "nonfinite_loss at step 3: the loss is NaN";
  f.value = std::nan("");
  f.last_step = 4;
  FactsDict d = facts_to_dict(f);
  std::vector<std::string> keys;
  for (const auto& kv : d) keys.push_back(kv.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"kind", "step", "severity", "tensor", "message",
                                            "value", "count", "last_step", "reproduces"}));
  EXPECT_TRUE(d.at("reproduces").isNone());
  EXPECT_TRUE(std::isnan(d.at("value").toDouble()));
  d.insert_or_assign("reproduces", true);
  const auto back = facts_from_dict<trainsan::Finding>(d);
  EXPECT_EQ(back.kind, "nonfinite_loss");
  EXPECT_EQ(back.count, 1);
  EXPECT_EQ(back.last_step, 4);
  ASSERT_TRUE(back.reproduces.has_value());
  EXPECT_TRUE(*back.reproduces);
  d.insert_or_assign("value", std::string("big"));
  const std::string e = error_of<c10::TypeError>([&] { facts_from_dict<trainsan::Finding>(d); });
  EXPECT_TRUE(has(e, "Finding.value: expected float, got str")) << e;
}

TEST(FactsDict, SanitizerArgsByName) {
  // Setup's table holds its fields by name; report, rerun_step and binding are outside it.
  std::vector<std::string> keys;
  for (const auto& kv : facts_to_dict(trainsan::Setup{})) keys.push_back(kv.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"mode_modules", "manual", "header_extra", "skip_frames",
                                            "buffers", "gathers_events"}));
  // Flattened as the Python package sends it: the records' counts and "<name>.<k>.<field>".
  const at::Tensor w = torch::zeros({3}, torch::requires_grad());
  FactsDict d = trainsan::facts_defaults("SanitizerArgs");
  d.insert_or_assign("parameters", int64_t{1});
  for (const auto& kv : trainsan::facts_defaults("Parameter")) {
    d.insert("parameters.0." + kv.key(), kv.value());
  }
  d.insert_or_assign("parameters.0.name", std::string("w"));
  d.insert_or_assign("parameters.0.tensor", w);
  d.insert_or_assign("parameters.0.group", int64_t{2});
  d.insert_or_assign("mode_modules", int64_t{1});
  for (const auto& kv : trainsan::facts_defaults("ModuleInfo")) {
    d.insert("mode_modules.0." + kv.key(), kv.value());
  }
  d.insert_or_assign("mode_modules.0.name", std::string("drop"));
  d.insert_or_assign("mode_modules.0.type", std::string("Dropout"));
  c10::impl::GenericList options(c10::AnyType::get());
  options.push_back(c10::ivalue::Tuple::create(std::string("policy"), std::string("record")));
  d.insert_or_assign("options", options);
  d.insert_or_assign("manual", true);
  d.insert_or_assign("gathers_events", true);
  auto args = facts_from_dict<trainsan::SanitizerArgs>(d);
  ASSERT_EQ(args.parameters.size(), 1u);
  EXPECT_EQ(args.parameters[0].name, "w");
  EXPECT_TRUE(args.parameters[0].tensor.is_same(w));
  EXPECT_EQ(args.parameters[0].group, 2);
  EXPECT_FALSE(args.parameters[0].local.defined());
  ASSERT_EQ(args.setup.mode_modules.size(), 1u);
  EXPECT_EQ(args.setup.mode_modules[0].type, "Dropout");
  EXPECT_TRUE(args.setup.mode_modules[0].mode_dependent);
  EXPECT_TRUE(args.setup.manual && args.setup.gathers_events);
  EXPECT_EQ(args.options, (std::vector<std::pair<std::string, std::string>>{{"policy", "record"}}));
  // What a wrong dict is told.
  FactsDict bad = d;
  bad.insert("modules", int64_t{1});
  std::string e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::SanitizerArgs>(bad); });
  EXPECT_TRUE(has(e,
                  "SanitizerArgs: unknown field 'modules' (the fields of SanitizerArgs are "
                  "parameters, options, mode_modules, manual,"))
      << e;
  bad = d;
  ASSERT_EQ(bad.erase("skip_frames"), 1u);
  e = error_of<c10::ValueError>([&] { facts_from_dict<trainsan::SanitizerArgs>(bad); });
  EXPECT_TRUE(has(e, "SanitizerArgs: missing field 'skip_frames' (list of str)")) << e;
  bad = d;
  bad.insert_or_assign("parameters.0.optimizer", std::string("adam"));
  e = error_of<c10::TypeError>([&] { facts_from_dict<trainsan::SanitizerArgs>(bad); });
  EXPECT_TRUE(has(e, "SanitizerArgs.parameters.0.optimizer: expected int, got str")) << e;
}

}  // namespace
