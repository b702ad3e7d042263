// Facts structs to and from dicts by field name (Note [Facts by name]): the one way facts cross
// from the Python package to the sanitizer (bindings/csrc/ops.cpp takes each as Dict(str, Any)).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <string>

namespace trainsan {

// Note [Facts by name]
// ~~~~~~~~~~~~~~~~~~~~
// A facts struct crosses the op library as one dict keyed by its field names (its table:
// trainsan/facts_table.h), so that neither side depends on the order of the fields. Values:
//   str, int, float (an int is taken too), bool, Tensor (None: undefined); an enum as its int;
//   a pair as a 2-tuple; a list as a list, or None for an empty one (TorchScript cannot type an
//   empty list that crosses as Any);
//   a record (a struct with a table), a list of records or an optional record, nested: a dict,
//   a list of dicts, a dict or None (as facts_to_dict writes them); or flattened into the same
//   dict: the count of records under the field's name (an optional one: 0 or 1) and record k's
//   fields under "<name>.<k>.<field>" — what the Python package sends, since a dict whose
//   values differ in type cannot cross nested.
// The sanitizer handle itself is built from one such dict (SanitizerArgs, sanitizer.h: the
// parameters, the options, and Setup's table setup.def), and each finding crosses back as one
// (Finding, finding.def).
// Every field must be present; an unknown key, a missing field or a value of another type is a
// c10::ValueError / c10::TypeError naming the struct and the field
// ("ResumeFacts.lr: expected float, got str").

using FactsDict = c10::Dict<std::string, c10::IValue>;

/// The facts struct T from its fields by name. Implemented for ResumeFacts, CheckpointFacts
/// (with CheckpointNonfinite), CheckpointContents (with OptimizerTensors, ModelTensors),
/// Provenance (with ModuleOrigin, RangeOverflow), ReplicaReport (with ReplicaMismatch),
/// SavedTensorChange, CustomGradResult, RerunFacts, ForeignBackward and RerunOutcome; Finding
/// (finding.def: each finding the handle reports, and one given back to it); SanitizerArgs (with
/// Parameter, ModuleInfo and Setup: the dict the handle is built from).
template <typename T>
T facts_from_dict(const FactsDict& fields);

/// Its fields by name, records nested (dicts, lists of dicts; None for an absent optional one).
template <typename T>
FactsDict facts_to_dict(const T& facts);

/// The fields of a default-constructed facts struct named `name` ("ResumeFacts"), as
/// facts_to_dict writes them: the Python package starts its dicts from these. Throws
/// c10::ValueError naming the structs there are for another name.
FactsDict facts_defaults(const std::string& name);

}  // namespace trainsan
