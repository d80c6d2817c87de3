// The QAPI input visitor: a QMP argument checked against its type, with QEMU's error texts.
#include "monitor/qapi_visit.h"

#include <algorithm>

namespace qmigd {

namespace {

QmpError bad_type(const std::string &path, const char *expected)
{
    return {"GenericError", "Invalid parameter type for '" + path + "', expected: " + expected};
}

std::optional<QmpError> check_members(const json &obj, const QapiType &t, const std::string &path,
                                      std::vector<std::string> *seen);

std::optional<QmpError> check_uint(const json &v, const std::string &name, const std::string &path,
                                   uint64_t max, const char *type_name)
{
    // QEMU reads every unsigned type as uint64 first (negative numbers
    // included, for compatibility), then checks the narrow range naming
    // the member alone (visit_type_uintN).
    if (!v.is_number_integer()) {
        return QmpError{"GenericError", "Parameter '" + path + "' expects uint64"};
    }
    if (max == UINT64_MAX) {
        return std::nullopt;
    }
    if (v.is_number_unsigned() ? v.get<uint64_t>() > max : v.get<int64_t>() < 0 ||
                                                               uint64_t(v.get<int64_t>()) > max) {
        return QmpError{"GenericError", "Parameter '" + name + "' expects " + type_name};
    }
    return std::nullopt;
}

std::optional<QmpError> check_value(const json &v, const QapiType &t, const std::string &name,
                                    const std::string &path);

// An int64 (visit_type_int64): a JSON integer that fits.
std::optional<QmpError> check_int(const json &v, const std::string &path)
{
    bool fits = v.is_number_integer() &&
                (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(INT64_MAX));
    return fits ? std::nullopt : std::optional(bad_type(path, "integer"));
}

// Whether `v` has the JSON type of `t` (QEMU's QType): how an alternate
// picks its branch.
bool same_json_type(const json &v, const QapiType &t)
{
    using K = QapiType::Kind;
    switch (t.kind) {
    case K::Str:
    case K::Enum:
        return v.is_string();
    case K::Bool:
        return v.is_boolean();
    case K::Null:
        return v.is_null();
    case K::List:
        return v.is_array();
    case K::Struct:
        return v.is_object();
    case K::Alternate:
        return false;
    default:
        return v.is_number();
    }
}

// The generated visit_type_<Alternate>: the branch of the value's JSON
// type, else an error naming the member alone and the alternate.
std::optional<QmpError> check_alternate(const json &v, const QapiType &t, const std::string &name,
                                        const std::string &path)
{
    for (const QapiType *b : t.branches) {
        if (same_json_type(v, *b)) {
            return check_value(v, *b, name, path);
        }
    }
    return bad_type(name, t.name.c_str());
}

std::optional<QmpError> check_struct(const json &v, const QapiType &t, const std::string &path)
{
    if (!v.is_object()) {
        return bad_type(path, "object");
    }
    std::vector<std::string> seen;
    if (auto e = check_members(v, t, path, &seen)) {
        return e;
    }
    for (auto it = v.begin(); it != v.end(); ++it) {
        if (std::find(seen.begin(), seen.end(), it.key()) == seen.end()) {
            return QmpError{"GenericError", "Parameter '" + (path.empty() ? "" : path + ".") +
                                                it.key() + "' is unexpected"};
        }
    }
    return std::nullopt;
}

std::optional<QmpError> check_value(const json &v, const QapiType &t, const std::string &name,
                                    const std::string &path)
{
    using K = QapiType::Kind;
    switch (t.kind) {
    case K::Str:
        return v.is_string() ? std::nullopt : std::optional(bad_type(path, "string"));
    case K::Bool:
        return v.is_boolean() ? std::nullopt : std::optional(bad_type(path, "boolean"));
    case K::Null:
        return v.is_null() ? std::nullopt : std::optional(bad_type(path, "null"));
    case K::Int:
        return check_int(v, path);
    case K::Uint8:
        return check_uint(v, name, path, UINT8_MAX, "uint8_t");
    case K::Uint16:
        return check_uint(v, name, path, UINT16_MAX, "uint16_t");
    case K::Uint32:
        return check_uint(v, name, path, UINT32_MAX, "uint32_t");
    case K::Uint64:
        return check_uint(v, name, path, UINT64_MAX, "uint64");
    case K::Enum:
        if (!v.is_string()) {
            return bad_type(path, "string");
        }
        if (std::find(t.values.begin(), t.values.end(), v.get<std::string>()) == t.values.end()) {
            return QmpError{"GenericError", "Parameter '" + name + "' does not accept value '" +
                                                v.get<std::string>() + "'"};
        }
        return std::nullopt;
    case K::List:
        if (!v.is_array()) {
            return bad_type(path, "array");
        }
        for (size_t i = 0; i < v.size(); i++) {
            // An element has no name: QEMU's visitors say "null" where
            // they name the member alone (enums, narrow integers).
            std::string p = path + "[" + std::to_string(i) + "]";
            if (auto e = check_value(v[i], *t.element, "null", p)) {
                return e;
            }
        }
        return std::nullopt;
    case K::Struct:
        return check_struct(v, t, path);
    case K::Alternate:
        return check_alternate(v, t, name, path);
    }
    return std::nullopt;
}

// The members of one JSON object: t's own, then (a flat union) those of
// the variant its discriminator picks, which share the object.
std::optional<QmpError> check_members(const json &obj, const QapiType &t, const std::string &path,
                                      std::vector<std::string> *seen)
{
    for (const auto &m : t.members) {
        std::string p = path.empty() ? m.name : path + "." + m.name;
        if (!obj.contains(m.name)) {
            if (m.optional) {
                continue;
            }
            return QmpError{"GenericError", "Parameter '" + p + "' is missing"};
        }
        seen->push_back(m.name);
        if (auto e = check_value(obj[m.name], *m.type, m.name, p)) {
            return e;
        }
    }
    if (!t.discriminator.empty()) {
        auto it = t.variants.find(obj[t.discriminator].get<std::string>());
        if (it != t.variants.end()) {
            return check_members(obj, *it->second, path, seen);
        }
    }
    return std::nullopt;
}

} // namespace

QapiType qapi_of_kind(QapiType::Kind k)
{
    QapiType t;
    t.kind = k;
    return t;
}

const QapiType kQapiStr = qapi_of_kind(QapiType::Kind::Str);
const QapiType kQapiBool = qapi_of_kind(QapiType::Kind::Bool);
const QapiType kQapiNull = qapi_of_kind(QapiType::Kind::Null);
const QapiType kQapiInt = qapi_of_kind(QapiType::Kind::Int);
const QapiType kQapiUint8 = qapi_of_kind(QapiType::Kind::Uint8);
const QapiType kQapiUint16 = qapi_of_kind(QapiType::Kind::Uint16);
const QapiType kQapiUint32 = qapi_of_kind(QapiType::Kind::Uint32);
const QapiType kQapiUint64 = qapi_of_kind(QapiType::Kind::Uint64);
const QapiType kQapiStrOrNull = qapi_alternate("StrOrNull", {&kQapiStr, &kQapiNull});
const QapiType kQapiNoArgs = qapi_struct({});

QapiType qapi_list_of(const QapiType *element)
{
    QapiType t = qapi_of_kind(QapiType::Kind::List);
    t.element = element;
    return t;
}

QapiType qapi_enum(std::vector<std::string> values)
{
    QapiType t = qapi_of_kind(QapiType::Kind::Enum);
    t.values = std::move(values);
    return t;
}

QapiType qapi_struct(std::vector<QapiType::Member> members)
{
    QapiType t = qapi_of_kind(QapiType::Kind::Struct);
    t.members = std::move(members);
    return t;
}

QapiType qapi_flat_union(const char *tag, const QapiType *tag_type,
                         std::map<std::string, const QapiType *> variants)
{
    QapiType t = qapi_struct({{tag, tag_type}});
    t.discriminator = tag;
    t.variants = std::move(variants);
    return t;
}

QapiType qapi_alternate(std::string name, std::vector<const QapiType *> branches)
{
    QapiType t = qapi_of_kind(QapiType::Kind::Alternate);
    t.name = std::move(name);
    t.branches = std::move(branches);
    return t;
}

std::optional<QmpError> qapi_check(const json &value, const QapiType &type,
                                   const std::string &name, const std::string &path)
{
    return check_value(value, type, name, path);
}

} // namespace qmigd
