// TrainSan's public C++ API: the fused statistics pass, the training-loop sanitizer, its one-line
// front door (trainsan::attach), the checks usable on their own (check_custom_grad,
// compare_reruns, check_checkpoint) and facts by name (facts_dict.h).
#pragma once

#include "trainsan/attach.h"
#include "trainsan/checkpoint.h"
#include "trainsan/custom_grad.h"
#include "trainsan/determinism_facts.h"
#include "trainsan/facts_dict.h"
#include "trainsan/finding.h"
#include "trainsan/kinds.h"
#include "trainsan/loss_walk.h"
#include "trainsan/options.h"
#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"
