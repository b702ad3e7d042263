// bad_checkpoint of a strict=False load that left renamed layers behind, and duplicate_batch of a
// resume that does not restore the data position: the ResumeCheck rules of
// Note [Renamed layers] and Note [Data position].
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checks/resume.h"

namespace trainsan::host {

// Note [Renamed layers]
// ~~~~~~~~~~~~~~~~~~~~~
// load_state_dict(strict=False) is how a new head, LoRA or adapter layers, or a dropped classifier
// are loaded around a pretrained trunk: the model's new parameters are missing from the state dict
// and keep their initialisation, by design. It is also how an old checkpoint is loaded into a
// refactored model, and then the renamed layers keep their initialisation silently while the
// state dict holds their trained tensors under the old names. What tells the two apart is the
// other side of the load: the keys the model did not take (unexpected). A new head or an adapter
// adds parameters the checkpoint never had; a rename leaves, for a missing parameter, a tensor of
// the same shape under another name. A missing parameter and an unexpected key are counterparts
// when
//  * their shapes are equal and their last name component (weight, bias, in_proj_weight) is the
//    same, paired in order: the model's registration order and the state dict's order (the old
//    model's registration order) agree for a rename — each missing parameter takes the next
//    unpaired unexpected key that fits; and
//  * the pair is more than a head swapped for another of the same size: both sit inside the
//    loaded trunk (a key the load filled comes after each in its own order: interior layers,
//    `blocks.0.attn.qkv.weight` saved, `layers.0.attention.qkv.weight` now, the embedding and
//    the head loaded around them; a PEFT-wrapped `q_proj.base_layer.weight` for the saved
//    `q_proj.weight`), or their names end alike beyond the last component (`qkv.weight`: a
//    module moved or renamed above its layers, wherever it sits).
// A rename where neither holds — a top-level module renamed at the end of the model beside a new
// layer (v2 adds a LayerNorm before the head and calls `head` `classifier`: the trained output
// layer is dropped and a random one trains) — is told by the model's structure, the place each
// sits between the keys that did load (missing_gap, unexpected_gap: the count of loaded keys
// before it, in the model's order and in the state dict's; a place in the state dict whose loaded
// neighbours are not neighbours in the model is none). Within one place, the unexpected keys are
// paired in order with the missing parameters of the same shape and last component (new layers in
// between are passed over), and the place's pairs count when
//  * every module the place leaves over in the checkpoint has a key paired: a rename leaves
//    nothing behind, while a fine-tune that drops a projector or the pretraining's heads and
//    builds a head that happens to match one of their layers leaves the rest over (BERT's
//    `cls.predictions` beside `cls.seq_relationship` for a `classifier` of two classes); and
//  * no module left over is still in the model holding no tensor: `model.head = nn.Identity()`
//    beside a new `classifier` (timm's reset_classifier, torchvision's fc = Identity) removed the
//    old layer on purpose.
// A new head of the same shape under a new name, the old name gone from the model and nothing
// else left over, cannot be told from a rename: it is reported, and the message says how to
// start it fresh (drop the old keys from the state dict, or keep the old module as
// nn.Identity()). Without the places (a C++ program that does not give them) only the first
// two signs are read.
// Such pairs are bad_checkpoint (error), naming the parameters left at their initialisation and
// their likely counterparts in the checkpoint. Silent: a new head or classifier (no unexpected
// key of its shape, the old one replaced by nn.Identity(), or other layers of the old head left
// over with it), adapters inserted between loaded layers (the checkpoint holds nothing left over
// for them), a classifier dropped from the state dict. A state dict that is the model's under a
// prefix is the prefix rule's (Note [Resume checks]); parameters frozen or in no optimizer are
// named there too and not again here.

// Note [Data position]
// ~~~~~~~~~~~~~~~~~~~~
// A resumed run should draw the batches that come after the checkpoint. Without the previous
// run's trace (Note [Replayed data]) the position is still judged in process, at the first
// training forward after the model's load (an event of its own: ResumeFacts::first_forward;
// a C++ program gathers its loader's facts itself), from the checkpoint's counters and the loader
// that fed that forward (the Python package: the DataLoader iterator made last since the
// checkpoint's torch.load, its batches per pass and how many it has yielded, its sampler, and the
// journal's loader and sampler loads, Note [Load journal]). Only a resume is judged: the
// checkpoint holds an optimizer state and an optimizer was restored from it (fine-tuning from a
// training checkpoint with a fresh optimizer, a checkpoint without counters, say nothing about
// the data position). Two rules, duplicate_batch (warning, as the trace's replay rule):
//  * mid-epoch restart: the checkpoint was saved inside an epoch — its step counter is not a
//    multiple of the loader's batches per pass (nor, with an epoch counter, a whole number of
//    epochs at some gradient accumulation: e*L divisible by the step for e the epoch counter or
//    the next), or, without a step counter, it holds a loader's or sampler's state — and the
//    forward's batch is the first of a fresh pass (one batch yielded) of a loader whose sampler
//    is torch's own (sequential, random, distributed: it starts at the epoch's first batch) and
//    that was not restored: the epoch's first batches, trained before the checkpoint, are
//    trained again. Skipping the consumed batches by hand (islice, `if i < start: continue`)
//    yields more than one batch before the forward; a StatefulDataLoader or sampler restored with
//    load_state_dict, a custom sampler or batch sampler (it may start anywhere), or a Subset over a
//    range of the data (the rest of an epoch) are taken as positioned.
//  * sampler epoch behind: the loader's sampler shuffles by epoch (set_epoch: DistributedSampler)
//    and its epoch is below the checkpoint's epoch counter: it draws the order of an epoch that
//    was trained already (epoch 0's, when set_epoch is not called on the restored epoch). The
//    counter may count the epochs done or name the epoch in progress, so a sampler at the counter
//    or one past it is fine; a sampler one behind a counter that names the last finished epoch
//    is the case this cannot tell from a correct resume.
// A resume at an epoch boundary with set_epoch(restored epoch), a restored loader, a skip by
// hand, fine-tuning and checkpoints without counters stay silent. A sampler reseeded from the
// global RNG (RandomSampler without a generator, the RNG not restored): Note [Replayed order].

// Note [Replayed order]
// ~~~~~~~~~~~~~~~~~~~~~
// torch's RandomSampler without a generator of its own draws each pass's permutation from a seed
// it takes from the global CPU generator when the pass begins (and the iterator's base seed for
// the workers too). A resumed job runs the same script: it seeds with the run's seed
// (torch.manual_seed, transformers' set_seed, lightning's seed_everything), builds the model,
// restores the checkpoint's model, optimizer and counters, and starts its loop at the restored
// epoch. If the checkpoint's RNG state is not restored, the generator went through the same draws
// since the same seed as in the first run, so the resumed epoch draws the permutation of the
// first run's first epoch (and, after it, its second...), and every dropout mask of the first
// steps again: the resumed run trains epoch 0's order at epoch E, and a mid-epoch resume that
// skips the consumed batches by hand skips batches of the wrong order (some samples twice, others
// never). The trace's replay rule (Note [Replayed data]) sees it only with the previous run's
// trace; in process the facts are how the global generator was last set before the pass began
// (the Python package watches torch.manual_seed, torch.set_rng_state and torch.seed while the load
// journal is held: Note [Load journal]). duplicate_batch (warning) at the first training forward
// after the model's load when
//   * the run is resumed (the checkpoint holds an optimizer state, an optimizer was restored from
//     it, and an epoch or step counter above 0), the loader was not restored and fed this forward;
//   * it shuffles with torch's RandomSampler drawing from the global generator;
//   * the generator was last set by torch.manual_seed, before the checkpoint's torch.load (the
//     run's seed, set at the start) or after it to the value of the seed set before it (the run's
//     seed again).
// Silent: the RNG restored (torch.set_rng_state of a saved state: HF's Trainer, accelerate's
// load_state and Lightning restore it), a sampler or loader restored (load_state_dict), a seed
// that changed after the load (torch.manual_seed(seed + epoch) per epoch: the epoch is in the
// seed), a loader with a generator of its own (DataLoader(generator=g), seeded per epoch or not:
// not seen), a DistributedSampler (seeded with its seed + set_epoch's epoch: the sampler-epoch rule
// above), torch.seed() (a random seed: no replay), an RNG whose seeding was not seen (an explicit
// attach after the seed without trainsan.watch_loads(): rng_last is ""), a fine-tune, a first run.
// A generator seeded once and given to the loader replays the same way and is not seen (torch's
// Generator.manual_seed cannot be watched).

namespace {

std::string leaf(const std::string& key) {
  const auto dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

/// The last two name components ("qkv.weight"), or "" for a name of one component.
std::string tail2(const std::string& key) {
  const auto last = key.rfind('.');
  if (last == std::string::npos || last == 0) return "";
  const auto before = key.rfind('.', last - 1);
  return before == std::string::npos ? key : key.substr(before + 1);
}

bool at(const std::vector<bool>& v, size_t k) { return k < v.size() && v[k]; }

/// The module of a key: the name without its last component ("" for a top-level key).
std::string module_of(const std::string& key) {
  const auto dot = key.rfind('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

/// Note [Renamed layers], by place: (missing, unexpected) index pairs of the places between the
/// loaded keys where every module left over has a key paired and none is a module kept empty.
std::vector<std::pair<size_t, size_t>> paired_in_place(const ResumeFacts& f) {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t nm = f.missing_params.size(), nu = f.unexpected_keys.size();
  if (f.missing_gap.size() != nm || f.unexpected_gap.size() != nu ||
      f.unexpected_replaced.size() != nu) {
    return out;  // not given
  }
  std::map<int64_t, std::vector<size_t>> places;  // place -> its unexpected keys, in order
  for (size_t j = 0; j < nu; ++j) {
    if (f.unexpected_gap[j] >= 0) places[f.unexpected_gap[j]].push_back(j);
  }
  for (const auto& [place, keys] : places) {
    std::vector<size_t> miss;  // the missing parameters in this place, in the model's order
    for (size_t i = 0; i < nm; ++i) {
      if (f.missing_gap[i] == place) miss.push_back(i);
    }
    std::map<std::string, bool> covered;  // module left over -> a key of it paired
    std::vector<std::pair<size_t, size_t>> found;
    bool replaced = false;
    size_t next = 0;  // the first missing parameter of `miss` not paired or passed over
    for (size_t j : keys) {
      replaced = replaced || f.unexpected_replaced[j];
      if (f.unexpected_shapes[j].empty()) continue;  // no tensor: nothing to pair
      bool& c = covered[module_of(f.unexpected_keys[j])];
      for (size_t k = next; k < miss.size(); ++k) {
        const size_t i = miss[k];
        if (f.missing_shapes[i] == f.unexpected_shapes[j] &&
            leaf(f.missing_params[i]) == leaf(f.unexpected_keys[j])) {
          found.emplace_back(i, j);
          next = k + 1;
          c = true;
          break;
        }
      }
    }
    bool all = !found.empty() && !replaced;
    for (const auto& [m, c] : covered) all = all && c;
    if (all) out.insert(out.end(), found.begin(), found.end());
  }
  return out;
}

}  // namespace

void ResumeCheck::renamed_layers(const ResumeFacts& f, int64_t step) {
  const auto& miss = f.missing_params;
  const auto& unexp = f.unexpected_keys;
  if (miss.empty() || unexp.empty() || f.missing_shapes.size() != miss.size() ||
      f.unexpected_shapes.size() != unexp.size()) {
    return;
  }
  std::vector<std::string> left, pairs;
  std::vector<bool> named(miss.size(), false), used(unexp.size(), false);
  size_t next = 0;  // the first unexpected key not paired or passed over yet
  for (size_t i = 0; i < miss.size(); ++i) {
    for (size_t j = next; j < unexp.size(); ++j) {
      if (f.unexpected_shapes[j].empty() || f.unexpected_shapes[j] != f.missing_shapes[i] ||
          leaf(unexp[j]) != leaf(miss[i])) {
        continue;
      }
      next = j + 1;
      const std::string t = tail2(miss[i]);
      const bool inside = at(f.missing_interior, i) && at(f.unexpected_interior, j);
      if (inside || (!t.empty() && t == tail2(unexp[j]))) {
        named[i] = used[j] = true;
        left.push_back(miss[i]);
        pairs.push_back(miss[i] + " (checkpoint: " + unexp[j] + ")");
      }
      break;
    }
  }
  for (const auto& [i, j] : paired_in_place(f)) {
    if (named[i] || used[j]) continue;
    named[i] = used[j] = true;
    left.push_back(miss[i]);
    pairs.push_back(miss[i] + " (checkpoint: " + unexp[j] + ")");
  }
  if (left.empty()) return;
  sink_.add(Kind::bad_checkpoint, left.front(),
            "model.load_state_dict(strict=False) left " + std::to_string(left.size()) +
                " parameter(s) at their initial values while the state dict holds tensors of "
                "the same shape under other names: " +
                join_names(pairs) +
                " — the model was refactored (modules renamed or moved) since the checkpoint was "
                "saved; map the old keys to the new names before loading (strict=True lists "
                "every key that does not match); a layer meant to start fresh: drop its old "
                "keys from the state dict before loading",
            static_cast<double>(left.size()), step);
}

void ResumeCheck::data_position(const ResumeFacts& f, int64_t step) {
  if (!f.checkpoint_has_optimizer_state || !f.optimizer_restored || f.loader_restored ||
      f.loader_yielded < 1) {
    return;  // not a resume of training, or the loader's position is its own
  }
  std::string ckpt;
  if (f.checkpoint_epoch >= 0) ckpt = "epoch=" + std::to_string(f.checkpoint_epoch);
  if (f.checkpoint_step >= 0) {
    ckpt += (ckpt.empty() ? "" : ", ") + (f.step_key.empty() ? std::string("step") : f.step_key) +
            "=" + std::to_string(f.checkpoint_step);
  }
  const std::string sampler = f.sampler_type.empty() ? std::string("sampler") : f.sampler_type;
  const int64_t L = f.loader_batches;
  bool mid = false;
  std::string why;
  if (L > 1 && f.checkpoint_step > 0) {
    const int64_t S = f.checkpoint_step;
    mid = S % L != 0;
    for (int64_t e = f.checkpoint_epoch; mid && e >= 0 && e <= f.checkpoint_epoch + 1; ++e) {
      if (e >= 1 && (e * L) % S == 0) mid = false;  // whole epochs at some accumulation
    }
    if (mid) {
      why = "the checkpoint (" + ckpt + ") was saved inside an epoch (" + std::to_string(S % L) +
            " batches into a pass of " + std::to_string(L) + ")";
    }
  } else if (L > 1 && f.checkpoint_step < 0 && !f.loader_state_key.empty()) {
    mid = true;
    why = "the checkpoint holds the data loader's position ('" + f.loader_state_key +
          "') but it was not restored";
  }
  if (mid && f.loader_yielded == 1) {
    sink_.add(Kind::duplicate_batch, "",
              "after the resume, the training forward at step " + std::to_string(step) +
                  " received the first batch of a fresh pass over the data loader: " + why +
                  ", and the loader restarts at the epoch's first batch — the batches trained "
                  "before the checkpoint are trained again; restore the loader's or sampler's "
                  "state (torchdata's StatefulDataLoader, sampler.load_state_dict), or skip the "
                  "consumed batches (itertools.islice(loader, start, None))",
              static_cast<double>(f.checkpoint_step), step);
  }
  replayed_order(f, step);
  if (f.sampler_epoch >= 0 && f.checkpoint_epoch > 0 && f.sampler_epoch < f.checkpoint_epoch) {
    sink_.add(Kind::duplicate_batch, "",
              "after the resume, the data loader's " + sampler + " is at epoch " +
                  std::to_string(f.sampler_epoch) + " while the checkpoint is from " + ckpt +
                  ": it shuffles as in epoch " + std::to_string(f.sampler_epoch) +
                  ", whose order was trained already — call sampler.set_epoch(epoch) with the "
                  "restored epoch counter at the start of each epoch",
              static_cast<double>(f.sampler_epoch), step);
  }
}

void ResumeCheck::replayed_order(const ResumeFacts& f, int64_t step) {
  // data_position has checked the resume of training and the loader not restored.
  if (!f.loader_global_rng || f.rng_last != "seed" ||
      (f.rng_seed_after_load && !f.rng_seed_repeats) ||
      (f.checkpoint_epoch <= 0 && f.checkpoint_step <= 0)) {
    return;
  }
  std::string ckpt;
  if (f.checkpoint_epoch >= 0) ckpt = "epoch=" + std::to_string(f.checkpoint_epoch);
  if (f.checkpoint_step >= 0) {
    ckpt += (ckpt.empty() ? "" : ", ") + (f.step_key.empty() ? std::string("step") : f.step_key) +
            "=" + std::to_string(f.checkpoint_step);
  }
  const std::string sampler =
      f.sampler_type.empty() ? std::string("RandomSampler") : f.sampler_type;
  // Named by the sampler: a finding of its own next to the data position's (the sink counts a
  // second finding of one kind and subject as a repeat).
  sink_.add(
      Kind::duplicate_batch, sampler,
      "after the resume from the checkpoint (" + ckpt + "), the data loader's " + sampler +
          " drew this pass's order from the global RNG, which was seeded (torch.manual_seed(" +
          std::to_string(f.rng_seed) + ")" +
          (f.rng_seed_after_load ? ", again after the checkpoint's load" : "") +
          ") and not restored: the resumed run draws its order from the same seeded state "
          "as a fresh run — the first epoch's order again (and its dropout masks), not the "
          "order that follows the checkpoint — save torch.get_rng_state() in the "
          "checkpoint and restore it with torch.set_rng_state(...), or put the epoch in "
          "the seed (torch.manual_seed(seed + epoch) at each epoch, or "
          "DataLoader(generator=torch.Generator().manual_seed(seed + epoch)))",
      static_cast<double>(f.checkpoint_epoch >= 0 ? f.checkpoint_epoch : f.checkpoint_step), step);
}

}  // namespace trainsan::host
