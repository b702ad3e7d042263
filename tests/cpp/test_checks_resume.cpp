// ResumeCheck's rules of host/checks/resume_data.cpp on synthetic facts: Note [Renamed layers]
// (a strict=False load of a refactored model) and Note [Data position] (a resume that replays
// the data), each with its legitimate twins silent.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace trainsan::host
