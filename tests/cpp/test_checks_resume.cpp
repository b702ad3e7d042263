// ResumeCheck's rules of host/checks/resume_data.cpp, resume_slots.cpp and resume.cpp on synthetic
// facts: Note [Renamed layers] (a strict=False load of a refactored model), Note [Data position]
// and Note [Replayed order] (a resume that replays the data), Note [Optimizer slots by name] (state
// restored by position after a reorder) and Note [Restarted schedule] (a scheduler rebuilt but not
// restored), each with its legitimate twins silent.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

ResumeFacts load(std::vector<std::string> missing, std::vector<std::string> mshapes,
                 std::vector<bool> minterior, std::vector<std::string> unexpected,
                 std::vector<std::string> ushapes, std::vector<bool> uinterior) {
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kModelLoad;
  f.missing_params = std::move(missing);
  f.missing_shapes = std::move(mshapes);
  f.missing_interior = std::move(minterior);
  f.unexpected_keys = std::move(unexpected);
  f.unexpected_shapes = std::move(ushapes);
  f.unexpected_interior = std::move(uinterior);
  return f;
}

TEST(RenamedLayers, InteriorRenameIsAnError) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(
      load({"layers.0.attention.qkv.weight", "layers.0.attention.qkv.bias"}, {"96x32", "96"},
           {true, true}, {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"}, {"96x32", "96"},
           {true, true}),
      0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::bad_checkpoint);
  EXPECT_EQ(sink.calls[0].tensor, "layers.0.attention.qkv.weight");
  EXPECT_TRUE(has(sink.calls[0].message,
                  "layers.0.attention.qkv.weight (checkpoint: blocks.0.attn.qkv.weight)"))
      << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "left 2 parameter(s) at their initial values"));
}

TEST(RenamedLayers, TrailingRenameWithTheSameTailIsAnError) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);  // a PEFT-wrapped layer: q_proj.base_layer.weight for q_proj.weight
  c.on_resume(
      load({"q_proj.base_layer.weight"}, {"32x32"}, {false}, {"q.weight"}, {"32x32"}, {false}), 0);
  EXPECT_TRUE(sink.calls.empty());  // tails differ ("base_layer.weight" / "q.weight")
  c.on_resume(
      load({"head.proj.weight"}, {"10x32"}, {false}, {"old.proj.weight"}, {"10x32"}, {false}), 1);
  ASSERT_EQ(sink.calls.size(), 1u);
}

TEST(RenamedLayers, NewHeadsAndAdaptersAreSilent) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  // A new head: nothing left over in the checkpoint.
  c.on_resume(load({"head.weight", "head.bias"}, {"10x32", "10"}, {false, false}, {}, {}, {}), 0);
  // A new head of other size than the old one, which is left over.
  c.on_resume(load({"head.weight", "head.bias"}, {"10x32", "10"}, {false, false},
                   {"fc.weight", "fc.bias"}, {"1000x32", "1000"}, {false, false}),
              0);
  // A head of the same size under another name, at the end of both: a head swap.
  c.on_resume(load({"classifier.weight"}, {"10x32"}, {false}, {"fc.weight"}, {"10x32"}, {false}),
              0);
  // Adapters between loaded layers; the checkpoint's old head (same shape) is trailing.
  c.on_resume(
      load({"blocks.0.adapter.weight"}, {"10x32"}, {true}, {"fc.weight"}, {"10x32"}, {false}), 0);
  // Same shape, another kind of parameter (weight for bias).
  c.on_resume(load({"layers.0.scale"}, {"32"}, {true}, {"blocks.0.bias"}, {"32"}, {true}), 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

/// The v1 -> v2 model of Note [Renamed layers]'s place rule: v1 = embed, blocks.0, head; v2 =
/// embed, blocks.0, norm (new), classifier (`head` renamed). Loaded: embed.{weight,bias},
/// blocks.0.{weight,bias}: 4 keys, so everything left over sits at place 4, the model's end.
ResumeFacts beside_a_new_layer(const std::string& width) {
  ResumeFacts f = load({"norm.weight", "norm.bias", "classifier.weight", "classifier.bias"},
                       {"16", "16", width + "x16", width}, {false, false, false, false},
                       {"head.weight", "head.bias"}, {width + "x16", width}, {false, false});
  f.missing_gap = {4, 4, 4, 4};
  f.unexpected_gap = {4, 4};
  f.unexpected_replaced = {false, false};
  return f;
}

TEST(RenamedLayers, TopLevelRenameBesideANewLayerIsAnError) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(beside_a_new_layer("4"), 0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::bad_checkpoint);
  EXPECT_EQ(sink.calls[0].tensor, "classifier.weight");
  EXPECT_TRUE(has(sink.calls[0].message,
                  "left 2 parameter(s) at their initial values while the state dict holds "
                  "tensors of the same shape under other names: classifier.weight (checkpoint: "
                  "head.weight), classifier.bias (checkpoint: head.bias)"))
      << sink.calls[0].message;
  // The new LayerNorm's bias has the old head's bias shape (16 classes): passed over, in order.
  c.on_resume(beside_a_new_layer("16"), 1);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[1].message,
                  "classifier.weight (checkpoint: head.weight), classifier.bias (checkpoint: "
                  "head.bias)"))
      << sink.calls[1].message;
  // A BatchNorm renamed: its buffers are left over too (no parameter missing for them), and the
  // module counts as paired through its weight and bias.
  ResumeFacts f =
      load({"bn2.weight", "bn2.bias"}, {"16", "16"}, {false, false},
           {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"},
           {"16", "16", "16", "16", ""}, {false, false, false, false, false});
  f.missing_gap = {6, 6};
  f.unexpected_gap = {6, 6, 6, 6, 6};
  f.unexpected_replaced = {false, false, false, false, false};
  c.on_resume(f, 2);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_TRUE(has(sink.calls[2].message, "left 2 parameter(s)")) << sink.calls[2].message;
}

TEST(RenamedLayers, FineTunesAroundTheTrunkAreSilentByPlace) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  // The old head replaced by nn.Identity() beside the new classifier: removed on purpose.
  ResumeFacts f = beside_a_new_layer("4");
  f.unexpected_replaced = {true, true};
  c.on_resume(f, 0);
  // A projector dropped (Linear(16, 16), ReLU, Linear(16, 4)) for a new fc = Linear(16, 4):
  // projector.2 matches the new head, projector.0 is left over unpaired.
  f = load({"fc.weight", "fc.bias"}, {"4x16", "4"}, {false, false},
           {"projector.0.weight", "projector.0.bias", "projector.2.weight", "projector.2.bias"},
           {"16x16", "16", "4x16", "4"}, {false, false, false, false});
  f.missing_gap = {4, 4};
  f.unexpected_gap = {4, 4, 4, 4};
  f.unexpected_replaced = {false, false, false, false};
  c.on_resume(f, 0);
  // The old head at the model's end, the new one inside the trunk (another place).
  f = beside_a_new_layer("4");
  f.missing_gap = {2, 2, 2, 2};
  c.on_resume(f, 0);
  // The old head's loaded neighbours are not neighbours in the model (the order differs).
  f = beside_a_new_layer("4");
  f.unexpected_gap = {-1, -1};
  c.on_resume(f, 0);
  // A head of another shape.
  f = beside_a_new_layer("4");
  f.unexpected_shapes = {"10x16", "10"};
  c.on_resume(f, 0);
  // Places given for one side only: not read.
  f = beside_a_new_layer("4");
  f.unexpected_gap.clear();
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

ResumeFacts first_forward() {
  ResumeFacts f;
  f.first_forward = true;
  f.checkpoint_has_optimizer_state = true;
  f.optimizer_restored = true;
  f.checkpoint_epoch = 1;
  f.checkpoint_step = 13;
  f.step_key = "step";
  f.loader_batches = 8;
  f.loader_yielded = 1;
  f.sampler_type = "RandomSampler";
  return f;
}

TEST(DataPosition, MidEpochRestartIsReported) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(first_forward(), 13);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::duplicate_batch);
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_TRUE(has(sink.calls[0].message,
                  "(epoch=1, step=13) was saved inside an epoch (5 "
                  "batches into a pass of 8)"))
      << sink.calls[0].message;
  ResumeFacts f = first_forward();  // no step counter, but the loader's state in the checkpoint
  f.checkpoint_step = -1;
  f.loader_state_key = "sampler";
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[1].message, "holds the data loader's position ('sampler')"));
}

TEST(DataPosition, PositionedOrNotAResumeIsSilent) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = first_forward();
  f.loader_yielded = 6;  // the consumed batches skipped by hand
  c.on_resume(f, 0);
  f = first_forward();
  f.loader_restored = true;  // StatefulDataLoader.load_state_dict
  c.on_resume(f, 0);
  f = first_forward();
  f.checkpoint_step = 16;  // at an epoch boundary
  c.on_resume(f, 0);
  f.checkpoint_epoch = 3;  // three epochs of 8 batches at an accumulation of 2
  f.checkpoint_step = 12;
  c.on_resume(f, 0);
  f = first_forward();
  f.loader_batches = -1;  // a custom sampler
  c.on_resume(f, 0);
  f = first_forward();
  f.optimizer_restored = false;  // fine-tuning with a fresh optimizer
  c.on_resume(f, 0);
  f = first_forward();
  f.checkpoint_has_optimizer_state = false;  // pretrained weights
  c.on_resume(f, 0);
  f = first_forward();
  f.checkpoint_step = -1;  // no counters
  f.checkpoint_epoch = -1;
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

TEST(DataPosition, SamplerEpochBehindTheCheckpoint) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = first_forward();
  f.checkpoint_step = 24;  // at a boundary: only the sampler's epoch is wrong
  f.checkpoint_epoch = 3;
  f.sampler_type = "DistributedSampler";
  f.sampler_epoch = 3;  // set_epoch(restored epoch)
  c.on_resume(f, 0);
  f.sampler_epoch = 4;  // the counter named the last finished epoch
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty());
  f.sampler_epoch = 0;  // set_epoch never called on the restored epoch
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_TRUE(has(sink.calls[0].message,
                  "DistributedSampler is at epoch 0 while the checkpoint "
                  "is from epoch=3, step=24"))
      << sink.calls[0].message;
}

/// The first step after optimizer.load_state_dict from a checkpoint with the model's state dict:
/// today's slots `now` in `groups`, the checkpoint's parameter keys `saved`.
ResumeFacts slots(std::vector<std::string> now, std::vector<int64_t> groups,
                  std::vector<std::string> registration, std::vector<std::string> saved) {
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "AdamW";
  f.optimizer_restored = true;
  f.stateful = true;
  f.optimizer_with_state = static_cast<int64_t>(now.size());
  for (const auto& n : now) {
    const bool weight = n.size() > 6 && n.substr(n.size() - 6) == "weight";
    const bool head = n.rfind("head.", 0) == 0;
    f.slot_shapes.push_back(head ? (weight ? "[4, 32]" : "[4]") : (weight ? "[32, 16]" : "[32]"));
  }
  f.slot_params = std::move(now);
  f.saved_group_sizes = groups;
  f.group_sizes = std::move(groups);
  f.param_order = std::move(registration);
  f.saved_param_order = std::move(saved);
  return f;
}

const std::vector<std::string> kSaved = {"numeric.weight", "numeric.bias", "text.weight",
                                         "text.bias",      "head.weight",  "head.bias"};
const std::vector<std::string> kReordered = {"text.weight",  "text.bias",   "numeric.weight",
                                             "numeric.bias", "head.weight", "head.bias"};

TEST(OptimizerSlots, ReorderedLayersOfOneShapeAreAnErrorWhateverTheScales) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = slots(kReordered, {6}, kReordered, kSaved);
  MomentScale m;  // scales within 100x: the moment rule alone would say nothing
  m.name = "text.weight";
  m.shape = "[32, 16]";
  m.moment = 2.0;
  m.grad = 1.0;
  f.moments = {m};
  c.on_resume(f, 7);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::optimizer_reset);
  EXPECT_EQ(sink.calls[0].severity, Severity::kError);
  EXPECT_EQ(sink.calls[0].tensor, "text.weight");
  EXPECT_EQ(sink.calls[0].value, 4.0);
  EXPECT_TRUE(has(sink.calls[0].message,
                  "optimizer 0 (AdamW)'s restored state does not fit its parameters"));
  EXPECT_TRUE(has(sink.calls[0].message,
                  "4 parameter(s) took the state of another of the same shape: text.weight "
                  "[32, 16] (the state of numeric.weight), text.bias [32] (the state of "
                  "numeric.bias), numeric.weight [32, 16] (the state of text.weight), "
                  "numeric.bias [32] (the state of text.bias)"))
      << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "restored by position after the parameter order changed"));
  EXPECT_FALSE(has(sink.calls[0].message, "head"));
  // The moment rule's own finding gives way to this one: scales 1000x apart both ways.
  f.moments = {m, m};
  f.moments[0].moment = 1000.0;
  f.moments[1].name = "numeric.weight";
  f.moments[1].moment = 1e-3;
  c.on_resume(f, 8);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[1].message, "took the state of another")) << sink.calls[1].message;
  // Decay and no-decay groups, no-decay first (timm's param_groups_weight_decay), each in
  // registration order: judged per group.
  c.on_resume(slots({"text.bias", "numeric.bias", "head.bias", "text.weight", "numeric.weight",
                     "head.weight"},
                    {3, 3}, kReordered, kSaved),
              9);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_TRUE(has(sink.calls[2].message,
                  "text.bias [32] (the state of numeric.bias), numeric.bias [32] (the state of "
                  "text.bias), text.weight [32, 16] (the state of numeric.weight)"))
      << sink.calls[2].message;
}

TEST(OptimizerSlots, UnambiguousFitsAndAmbiguousMappingsAreSilent) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(slots(kSaved, {6}, kSaved, kSaved), 0);  // not reordered
  // Groups that bind by module (the text branch, then the rest): the same sets either way.
  c.on_resume(slots({"text.weight", "text.bias", "numeric.weight", "numeric.bias", "head.weight",
                     "head.bias"},
                    {2, 4}, kReordered, kSaved),
              0);
  // A group in another order than the registration's (hand-listed modules): not predicted.
  c.on_resume(slots({"numeric.weight", "numeric.bias", "text.weight", "text.bias", "head.weight",
                     "head.bias"},
                    {6}, kReordered, kSaved),
              0);
  // In name order as well as in registration order (minGPT sorts each group by name): either
  // construction explains the groups, and they disagree on the saved slots.
  c.on_resume(slots({"a.weight", "b.weight", "a.bias", "b.bias"}, {2, 2},
                    {"a.weight", "a.bias", "b.weight", "b.bias"},
                    {"b.weight", "b.bias", "a.weight", "a.bias"}),
              0);
  ResumeFacts f = slots(kReordered, {6}, kReordered, kSaved);
  f.saved_group_sizes = {5, 1};  // groups that differ (torch raises on sizes)
  c.on_resume(f, 0);
  f = slots(kReordered, {6}, kReordered, kSaved);
  f.slot_params[5] = "";  // a parameter that is not the loaded model's
  c.on_resume(f, 0);
  f = slots(kReordered, {6}, kReordered, kSaved);
  f.saved_param_order[0] = "numeric_proj.weight";  // renamed since: 5 of 6 slots known
  c.on_resume(f, 0);
  f = slots(kReordered, {6}, kReordered, kSaved);
  f.slot_shapes[0] = "[32, 8]";  // another shape: the load's own rule (state_mismatched)
  f.slot_shapes[1] = "[64]";
  c.on_resume(f, 0);
  f = slots(kReordered, {6}, kReordered, kSaved);
  f.slot_params.clear();  // not given: the moment rule alone
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

// -- Note [Replayed order] ----------------------------------------------------------------------

ResumeFacts seeded_boundary() {  // a resume at an epoch boundary: the data position is right
  ResumeFacts f = first_forward();
  f.checkpoint_epoch = 2;
  f.checkpoint_step = 16;
  f.loader_global_rng = true;
  f.rng_last = "seed";
  f.rng_seed = 42;
  return f;
}

TEST(ReplayedOrder, SeededAndNotRestoredIsReported) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(seeded_boundary(), 16);  // torch.manual_seed(42) at the top, before the load
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::duplicate_batch);
  EXPECT_EQ(sink.calls[0].tensor, "RandomSampler");  // a subject of its own
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_EQ(sink.calls[0].step, 16);
  EXPECT_EQ(sink.calls[0].value, 2.0);  // the checkpoint's epoch
  EXPECT_TRUE(has(sink.calls[0].message,
                  "after the resume from the checkpoint (epoch=2, step=16), the data loader's "
                  "RandomSampler drew this pass's order from the global RNG, which was seeded "
                  "(torch.manual_seed(42)) and not restored"))
      << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "torch.set_rng_state"));
  ResumeFacts f = seeded_boundary();  // the run's seed set again after the load
  f.rng_seed_after_load = true;
  f.rng_seed_repeats = true;
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[1].message, "again after the checkpoint's load"));
  f = seeded_boundary();  // only a step counter, at the end of the first pass of 8
  f.checkpoint_epoch = -1;
  f.checkpoint_step = 8;
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_EQ(sink.calls[2].value, 8.0);
  f = first_forward();  // mid-epoch: both the restarted pass and its order
  f.loader_global_rng = true;
  f.rng_last = "seed";
  c.on_resume(f, 0);
  EXPECT_EQ(sink.calls.size(), 5u);
}

TEST(ReplayedOrder, RestoredReseededOrOwnGeneratorIsSilent) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = seeded_boundary();
  f.rng_last = "restore";  // torch.set_rng_state(ckpt["rng"])
  c.on_resume(f, 0);
  f.rng_last = "random";  // torch.seed()
  c.on_resume(f, 0);
  f.rng_last = "";  // the seeding was not seen
  c.on_resume(f, 0);
  f = seeded_boundary();  // torch.manual_seed(seed + epoch) after the load
  f.rng_seed_after_load = true;
  c.on_resume(f, 0);
  f = seeded_boundary();
  f.loader_global_rng = false;  // a generator of its own, a DistributedSampler, no shuffle
  c.on_resume(f, 0);
  f = seeded_boundary();
  f.loader_restored = true;  // the sampler's or loader's state restored
  c.on_resume(f, 0);
  f = seeded_boundary();
  f.checkpoint_epoch = 0;  // nothing trained yet
  f.checkpoint_step = 0;
  c.on_resume(f, 0);
  f = seeded_boundary();
  f.optimizer_restored = false;  // a fine-tune
  c.on_resume(f, 0);
  f = seeded_boundary();
  f.loader_yielded = -1;  // no loader iterated since the load
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

// -- Note [Restarted schedule] ------------------------------------------------------------------

ResumeFacts first_step_unrestored_scheduler() {
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "AdamW";
  f.stateful = true;
  f.optimizer_restored = true;
  f.optimizer_with_state = 4;
  f.checkpoint_has_optimizer_state = true;
  f.scheduler_epoch = 1024;
  f.scheduler_type = "LambdaLR";
  f.scheduler_epoch_now = 0;
  f.scheduler_by_epoch = true;
  f.lr = 1024;  // the optimizer's state brought the saved rate back
  f.checkpoint_lr = 1024;
  return f;
}

// A later step whose rate changed: the group's rate, the one the scheduler set last, and the one
// the checkpoint's schedule has at this step (1024: a warm-up over, a constant schedule after it).
ResumeFacts rate_changed(double lr, double scheduler_lr, double schedule_lr = 1024,
                         int64_t epoch = 1) {
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kScheduleStep;
  f.opt = 0;
  f.lr = lr;
  f.scheduler_lr = scheduler_lr;
  f.schedule_lr = schedule_lr;
  f.scheduler_epoch_now = epoch;
  return f;
}

TEST(RestartedSchedule, TheRateLeavingTheScheduleIsAnError) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  c.on_resume(first_step_unrestored_scheduler(), 40);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_TRUE(has(sink.calls[0].message, "its LambdaLR is at epoch 0: the schedule restarts"))
      << sink.calls[0].message;
  c.on_resume(rate_changed(128, 128), 41);  // the warm-up's first rate
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].kind, Kind::optimizer_reset);
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[1].tensor, "LambdaLR of optimizer 0");  // not a repeat of the warning
  EXPECT_EQ(sink.calls[1].severity, Severity::kError);
  EXPECT_EQ(sink.calls[1].step, 41);
  EXPECT_EQ(sink.calls[1].value, 128.0);
  EXPECT_TRUE(has(sink.calls[1].message,
                  "the learning-rate scheduler LambdaLR of optimizer 0 (AdamW) was rebuilt but "
                  "not restored"))
      << sink.calls[1].message;
  EXPECT_TRUE(has(sink.calls[1].message,
                  "it set the learning rate to 128 (its epoch 1), where the checkpoint's schedule "
                  "is at epoch 1025 with 1024 (it was saved at epoch 1024 with 1024)"))
      << sink.calls[1].message;
  EXPECT_TRUE(has(sink.calls[1].message, "1024 epoch(s) behind the checkpoint"));
  EXPECT_TRUE(has(sink.calls[1].message, "scheduler.load_state_dict"));
  c.on_resume(rate_changed(64, 64, 1024, 2), 42);  // judged once
  EXPECT_EQ(sink.calls.size(), 2u);
  // A cosine restarted at its peak: the rate goes up.
  c.on_resume(first_step_unrestored_scheduler(), 0);
  c.on_resume(rate_changed(4096, 4096), 1);
  ASSERT_EQ(sink.calls.size(), 4u);
  EXPECT_EQ(sink.calls[3].severity, Severity::kError);
}

TEST(RestartedSchedule, AtTheEdgeOfTheJump) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  // kLrJump = 1e-3 of the larger rate: 1.024 for 1024.
  c.on_resume(first_step_unrestored_scheduler(), 0);
  c.on_resume(rate_changed(1023, 1023), 1);  // 1 apart: the schedule moved as a continued one
  EXPECT_EQ(sink.calls.size(), 1u);          // the first step's warning alone; watched on
  c.on_resume(rate_changed(1000, 1000, 1000.5, 2), 2);  // 0.5 apart (the edge is 1): still on it
  EXPECT_EQ(sink.calls.size(), 1u);
  // It leaves the checkpoint's schedule gradually (a cosine restarted from the restored rate):
  // the first change more than the edge off is the error.
  c.on_resume(rate_changed(990, 990, 1000, 3), 3);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].severity, Severity::kError);
  EXPECT_EQ(sink.calls[1].step, 3);
  c.on_resume(rate_changed(100, 100, 1000, 4), 4);  // judged once
  EXPECT_EQ(sink.calls.size(), 2u);
  c.on_resume(first_step_unrestored_scheduler(), 0);
  c.on_resume(rate_changed(1022, 1022), 1);  // 2 apart
  ASSERT_EQ(sink.calls.size(), 4u);
  EXPECT_EQ(sink.calls[3].severity, Severity::kError);
  // A rate set by hand (not the scheduler's last rate) ends the watch silently.
  c.on_resume(first_step_unrestored_scheduler(), 0);
  c.on_resume(rate_changed(500, 1024), 1);
  c.on_resume(rate_changed(100, 100), 2);
  EXPECT_EQ(sink.calls.size(), 5u);  // the first step's warning alone
}

TEST(RestartedSchedule, LegitimateTwinsAreSilent) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = first_step_unrestored_scheduler();
  f.scheduler_restored = true;  // scheduler.load_state_dict
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  f = first_step_unrestored_scheduler();
  f.scheduler_epoch_now = 1024;  // rebuilt with last_epoch=restored epoch
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  f.scheduler_epoch_now = 1025;
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
  c.on_resume(rate_changed(128, 128), 0);  // no first step before it
  EXPECT_TRUE(sink.calls.empty());
  // The first step's warning stays for each of these; the later change is not an error.
  f = first_step_unrestored_scheduler();
  f.scheduler_by_epoch = false;  // ReduceLROnPlateau lowers the restored rate
  f.scheduler_type = "ReduceLROnPlateau";
  c.on_resume(f, 0);
  c.on_resume(rate_changed(102.4, 102.4), 9);
  f = first_step_unrestored_scheduler();
  c.on_resume(f, 0);
  c.on_resume(rate_changed(500, 1024), 3);  // set by hand: not the scheduler's rate
  c.on_resume(rate_changed(128, 128), 4);   // the watch ended there
  f = first_step_unrestored_scheduler();
  f.scheduler_type = "";  // no scheduler found (another library's)
  f.scheduler_epoch_now = -1;
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  f = first_step_unrestored_scheduler();
  f.scheduler_by_epoch = false;  // a scheduler whose rate at an epoch cannot be computed
  f.scheduler_type = "CosineAnnealingWarmRestarts";
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  ASSERT_EQ(sink.calls.size(), 4u);
  for (const auto& call : sink.calls) EXPECT_EQ(call.severity, Severity::kWarning);
  sink.calls.clear();
  // The optimizer not restored either (a forgotten optimizer, or a fine-tune's new optimizer):
  // that error (or silence) explains the rate; no second error.
  f = first_step_unrestored_scheduler();
  f.optimizer_restored = false;
  f.optimizer_with_state = 0;
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[0].message, "was not restored (no optimizer.load_state_dict"));
  EXPECT_EQ(sink.calls[1].severity, Severity::kWarning);
  sink.calls.clear();
  f.params_not_loaded = 2;  // a fine-tune: a new head after the load
  c.on_resume(f, 0);
  c.on_resume(rate_changed(128, 128), 1);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
  // Built after optimizer.load_state_dict: the jump is the first step's error, and only it.
  f = first_step_unrestored_scheduler();
  f.lr = 128;
  c.on_resume(f, 0);
  c.on_resume(rate_changed(256, 256, 1024, 2), 1);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].severity, Severity::kError);
}

}  // namespace
}  // namespace trainsan::host
