// Every check family (Note [Checks as units], checks/check.h), one header each, held together by
// Checks in the order the sanitizer runs them. Torch-free.
#pragma once

#include <cstddef>

#include "checks/accumulation.h"
#include "checks/autograd.h"
#include "checks/checkpoint.h"
#include "checks/determinism.h"
#include "checks/gradient_flow.h"
#include "checks/inputs.h"
#include "checks/loss.h"
#include "checks/magnitudes.h"
#include "checks/mode.h"
#include "checks/nonfinite.h"
#include "checks/precision.h"
#include "checks/replicas.h"
#include "checks/resume.h"
#include "checks/step_integrity.h"

namespace trainsan::host {

/// Each family: one class, one header, one file; constructed with the sink and the options. The
/// sanitizer calls every family's event methods in the order of Checks.
///
/// Every family, in the order the sanitizer runs them on a step (the order findings appear in:
/// the hook observations, the numbers of the pass, the step-level rules, the mode).
struct Checks {
  Checks(FindingSink& sink, const Options& opts, size_t num_params)
      : origins(opts),
        flow(sink, opts, num_params),
        nonfinite(sink, opts, origins),
        magnitudes(sink, opts),
        integrity(sink, opts),
        mode(sink, opts),
        inputs(sink, opts),
        loss(sink, opts),
        autograd(sink, opts),
        replicas(sink, opts),
        precision(sink, opts, origins),
        checkpoint(sink, opts),
        resume(sink, opts),
        determinism(sink, opts),
        accumulation(sink, opts) {}
  Origins origins;
  GradientFlowCheck flow;
  NonfiniteCheck nonfinite;
  MagnitudeCheck magnitudes;
  StepIntegrityCheck integrity;
  ModeCheck mode;
  InputsCheck inputs;
  LossCheck loss;
  AutogradCheck autograd;
  ReplicaCheck replicas;
  PrecisionCheck precision;
  CheckpointCheck checkpoint;
  ResumeCheck resume;
  DeterminismCheck determinism;
  AccumulationCheck accumulation;
};

}  // namespace trainsan::host
