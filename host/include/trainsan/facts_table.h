// Facts structs as tables: each struct's fields are the rows of an X-macro file next to its header
// (resume_facts.def, ...), included twice — once inside the struct for the fields, once for
// FactTable<T>::each, the visitor that the by-name conversion (trainsan/facts_dict.h) walks.
// Torch-free.
//
// A row is TRAINSAN_FACT(type, name, initial value, doc); a type whose spelling holds a comma
// needs an alias. The field types the conversion knows: std::string, int64_t, double, bool, an
// enum with a FactEnum specialisation, another struct with a FactTable (a record), std::pair and
// std::vector of those, std::optional of a record (and, in LibTorch headers, at::Tensor).
#pragma once

namespace trainsan {

/// The table of facts struct T, specialised next to it:
///   static constexpr const char* kName;        // "ResumeFacts"
///   template <class S, class F> static void each(S& s, F&& f);  // f("field", s.field) per row
template <typename T>
struct FactTable;

/// An enum field crosses as an integer 0..kMax; specialised next to the enum.
template <typename E>
struct FactEnum;

}  // namespace trainsan

// Expansions of a row: the field itself, and one call of the visitor.
#define TRAINSAN_FACT_FIELD(type, name, init, doc) type name = init;
#define TRAINSAN_FACT_VISIT(type, name, init, doc) f(#name, s.name);
