// Facts structs to and from dicts by field name (Note [Facts by name] in trainsan/facts_dict.h),
// one generic walk over the structs' tables (trainsan/facts_table.h).
#include "trainsan/facts_dict.h"

#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "trainsan/autograd_facts.h"
#include "trainsan/checkpoint.h"
#include "trainsan/checkpoint_facts.h"
#include "trainsan/determinism_facts.h"
#include "trainsan/finding.h"
#include "trainsan/precision_facts.h"
#include "trainsan/replica_facts.h"
#include "trainsan/resume_facts.h"
#include "trainsan/sanitizer.h"

namespace trainsan {
namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;

template <class T, class = void>
struct IsRecord : std::false_type {};
template <class T>
struct IsRecord<T, std::void_t<decltype(FactTable<T>::kName)>> : std::true_type {};
template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};
template <class T>
struct IsPair : std::false_type {};
template <class A, class B>
struct IsPair<std::pair<A, B>> : std::true_type {};
template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};
// A field holding records: a list of them, or an optional one.
template <class T>
struct HoldsRecords : std::false_type {};
template <class T>
struct HoldsRecords<std::vector<T>> : IsRecord<T> {};
template <class T>
struct HoldsRecords<std::optional<T>> : IsRecord<T> {};

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, std::string>) {
    return "str";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_enum_v<T>) {
    return "int 0.." + std::to_string(FactEnum<T>::kMax);
  } else if constexpr (std::is_integral_v<T>) {
    return "int";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "float";
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    return "Tensor";
  } else if constexpr (IsRecord<T>::value) {
    return FactTable<T>::kName;
  } else if constexpr (IsPair<T>::value) {
    return "(" + type_name<typename T::first_type>() + ", " + type_name<typename T::second_type>() +
           ")";
  } else if constexpr (IsVector<T>::value) {
    return "list of " + type_name<typename T::value_type>();
  } else {
    static_assert(IsOptional<T>::value, "a field type the facts tables do not know");
    return type_name<typename T::value_type>() + " or None";
  }
}

// What a value is, in Python's words.
std::string kind_of(const IValue& v) {
  if (v.isNone()) return "None";
  if (v.isString()) return "str";
  if (v.isBool()) return "bool";
  if (v.isInt()) return "int";
  if (v.isDouble()) return "float";
  if (v.isTensor()) return "Tensor";
  if (v.isList()) return "list";
  if (v.isTuple()) return "tuple";
  if (v.isGenericDict()) return "dict";
  return v.tagKind();
}

template <class T>
[[noreturn]] void wrong_type(const std::string& where, const IValue& v) {
  C10_THROW_ERROR(TypeError, c10::str(where, ": expected ", type_name<T>(), ", got ", kind_of(v)));
}

template <class T>
void read_record(const GenericDict& d, const std::string& where, T& out);

template <class T>
void read_value(const IValue& v, const std::string& where, T& out) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!v.isString()) wrong_type<T>(where, v);
    out = v.toStringRef();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.isBool()) wrong_type<T>(where, v);
    out = v.toBool();
  } else if constexpr (std::is_enum_v<T>) {
    if (!v.isInt()) wrong_type<T>(where, v);
    const int64_t k = v.toInt();
    TORCH_CHECK_VALUE(k >= 0 && k <= FactEnum<T>::kMax, where, ": ", k, " is not one of 0..",
                      FactEnum<T>::kMax);
    out = static_cast<T>(k);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (!v.isInt()) wrong_type<T>(where, v);
    out = v.toInt();
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.isDouble() && !v.isInt()) wrong_type<T>(where, v);
    out = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    if (!v.isTensor() && !v.isNone()) wrong_type<T>(where, v);
    out = v.isNone() ? at::Tensor() : v.toTensor();
  } else if constexpr (IsRecord<T>::value) {
    if (!v.isGenericDict()) wrong_type<T>(where, v);
    read_record(v.toGenericDict(), where, out);
  } else if constexpr (IsPair<T>::value) {
    if (!v.isTuple() || v.toTupleRef().elements().size() != 2) wrong_type<T>(where, v);
    read_value(v.toTupleRef().elements()[0], where + "[0]", out.first);
    read_value(v.toTupleRef().elements()[1], where + "[1]", out.second);
  } else if constexpr (IsVector<T>::value) {
    out.clear();
    if (v.isNone()) return;  // an empty list (Note [Facts by name])
    if (!v.isList()) wrong_type<T>(where, v);
    const auto elems = v.toListRef();
    out.reserve(elems.size());
    for (size_t k = 0; k < elems.size(); ++k) {
      typename T::value_type x{};
      read_value(elems[k], where + "[" + std::to_string(k) + "]", x);
      out.push_back(std::move(x));
    }
  } else {
    static_assert(IsOptional<T>::value, "a field type the facts tables do not know");
    out.reset();
    if (v.isNone()) return;
    typename T::value_type x{};
    read_value(v, where, x);
    out = std::move(x);
  }
}

// The fields of one struct in a dict, by key prefix: "" for a dict of its own, "name.k." for
// record k of a list flattened into its parent's dict.
class Reader {
 public:
  Reader(const GenericDict& d, std::string where) : d_(d), where_(std::move(where)) {}

  template <class T>
  void record(const std::string& prefix, T& out) {
    FactTable<T>::each(out, [&](const char* name, auto& field) { read(prefix + name, field); });
  }

  // Every key was read: none is unknown.
  template <class T>
  void finish() {
    for (const auto& kv : d_) {
      const IValue& key = kv.key();
      TORCH_CHECK_VALUE(key.isString(), where_, ": a key of ", kind_of(key), " type");
      if (seen_.count(key.toStringRef()) == 0) {
        std::string fields;
        const T proto{};
        FactTable<T>::each(proto, [&](const char* name, const auto& /*field*/) {
          fields += (fields.empty() ? "" : ", ") + std::string(name);
        });
        TORCH_CHECK_VALUE(false, where_, ": unknown field '", key.toStringRef(),
                          "' (the fields of ", FactTable<T>::kName, " are ", fields, ")");
      }
    }
  }

 private:
  template <class F>
  void read(const std::string& key, F& out) {
    const std::string where = where_ + "." + key;
    const auto it = d_.find(key);
    TORCH_CHECK_VALUE(it != d_.end(), where_, ": missing field '", key, "' (", type_name<F>(),
                      "): every field of the table is required (facts_defaults(name) gives a "
                      "struct's defaults to start from)");
    seen_.insert(key);
    const IValue& v = it->value();
    if constexpr (HoldsRecords<F>::value) {
      if (v.isInt()) {  // flattened: the count here, the records' fields under "key.k."
        using R = typename F::value_type;
        const int64_t n = v.toInt();
        TORCH_CHECK_VALUE(n >= 0 && (IsVector<F>::value || n <= 1), where, ": ", n,
                          " is not a count of ", type_name<F>());
        std::vector<R> rs(static_cast<size_t>(n));
        for (size_t k = 0; k < rs.size(); ++k) record(key + "." + std::to_string(k) + ".", rs[k]);
        if constexpr (IsVector<F>::value) {
          out = std::move(rs);
        } else {
          out = rs.empty() ? std::nullopt : std::optional<R>(std::move(rs[0]));
        }
        return;
      }
    }
    read_value(v, where, out);
  }

  const GenericDict& d_;
  std::string where_;
  std::unordered_set<std::string> seen_;
};

template <class T>
void read_record(const GenericDict& d, const std::string& where, T& out) {
  Reader r(d, where);
  r.record("", out);
  r.finish<T>();
}

template <class T>
IValue to_ivalue(const T& v) {
  if constexpr (std::is_enum_v<T>) {
    return static_cast<int64_t>(v);
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    return v.defined() ? IValue(v) : IValue();
  } else if constexpr (IsRecord<T>::value) {
    return facts_to_dict(v);
  } else if constexpr (IsPair<T>::value) {
    return c10::ivalue::Tuple::create(to_ivalue(v.first), to_ivalue(v.second));
  } else if constexpr (IsVector<T>::value) {
    c10::impl::GenericList out(c10::AnyType::get());
    out.reserve(v.size());
    for (const auto& x : v) out.push_back(to_ivalue<typename T::value_type>(x));
    return out;
  } else if constexpr (IsOptional<T>::value) {
    return v ? to_ivalue(*v) : IValue();
  } else {
    return IValue(v);
  }
}

}  // namespace

template <typename T>
T facts_from_dict(const FactsDict& fields) {
  T out;
  read_record(c10::impl::toGenericDict(fields), FactTable<T>::kName, out);
  return out;
}

template <typename T>
FactsDict facts_to_dict(const T& facts) {
  auto out = c10::impl::toTypedDict<std::string, IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  FactTable<T>::each(
      facts, [&](const char* name, const auto& field) { out.insert(name, to_ivalue(field)); });
  return out;
}

namespace {

template <class... T>
FactsDict defaults_of(const std::string& name) {
  std::optional<FactsDict> out;
  ((name == FactTable<T>::kName ? (void)(out = facts_to_dict(T{})) : (void)0), ...);
  std::string names;
  ((names += (names.empty() ? "" : ", ") + std::string(FactTable<T>::kName)), ...);
  TORCH_CHECK_VALUE(out.has_value(), "facts_defaults: no facts struct is named '", name,
                    "'; there are ", names);
  return *out;
}

}  // namespace

FactsDict facts_defaults(const std::string& name) {
  return defaults_of<ResumeFacts, CheckpointFacts, CheckpointNonfinite, CheckpointContents,
                     OptimizerTensors, ModelTensors, Provenance, ModuleOrigin, RangeOverflow,
                     ReplicaReport, ReplicaMismatch, SavedTensorChange, CustomGradResult,
                     RerunFacts, ForeignBackward, RerunOutcome, Finding, SanitizerArgs, Parameter,
                     ModuleInfo, Setup>(name);
}

#define TRAINSAN_FACTS_DICT(T)                     \
  template T facts_from_dict<T>(const FactsDict&); \
  template FactsDict facts_to_dict<T>(const T&);
TRAINSAN_FACTS_DICT(ResumeFacts)
TRAINSAN_FACTS_DICT(CheckpointFacts)
TRAINSAN_FACTS_DICT(CheckpointNonfinite)
TRAINSAN_FACTS_DICT(CheckpointContents)
TRAINSAN_FACTS_DICT(OptimizerTensors)
TRAINSAN_FACTS_DICT(ModelTensors)
TRAINSAN_FACTS_DICT(Provenance)
TRAINSAN_FACTS_DICT(ModuleOrigin)
TRAINSAN_FACTS_DICT(RangeOverflow)
TRAINSAN_FACTS_DICT(ReplicaReport)
TRAINSAN_FACTS_DICT(ReplicaMismatch)
TRAINSAN_FACTS_DICT(SavedTensorChange)
TRAINSAN_FACTS_DICT(CustomGradResult)
TRAINSAN_FACTS_DICT(RerunFacts)
TRAINSAN_FACTS_DICT(ForeignBackward)
TRAINSAN_FACTS_DICT(RerunOutcome)
TRAINSAN_FACTS_DICT(Finding)
TRAINSAN_FACTS_DICT(SanitizerArgs)
TRAINSAN_FACTS_DICT(Parameter)
TRAINSAN_FACTS_DICT(ModuleInfo)
TRAINSAN_FACTS_DICT(Setup)
#undef TRAINSAN_FACTS_DICT

}  // namespace trainsan
