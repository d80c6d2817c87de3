// A small QAPI input visitor: checks a QMP argument against a type from
// QEMU's schema with the errors QEMU 10's qobject-input visitor gives, in
// its order (members in schema order, a missing one when reached, unknown
// members once a struct's members are done; "channels[0].addr.host" style
// names). QmpServer checks every command's arguments with it before the
// handler runs (register_command), so handlers read arguments of the
// right types; vm.json is read through it too.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "monitor/qmp_server.h"

namespace qmigd {

struct QapiType {
    enum class Kind { Str, Bool, Null, Int, Uint8, Uint16, Uint32, Uint64, Enum, List, Struct,
                      Alternate };
    Kind kind = Kind::Str;
    std::vector<std::string> values; // Enum
    const QapiType *element = nullptr; // List
    // Alternate: its name (QEMU's error says it) and the branches, at most
    // one per JSON type (QAPI's rule), picked by the value's JSON type.
    std::string name;
    std::vector<const QapiType *> branches;
    struct Member {
        std::string name;
        const QapiType *type;
        bool optional = false;
    };
    // Struct: its members; a flat union's base members come first.
    std::vector<Member> members;
    // Flat union: the discriminator (an Enum member above) and, per value,
    // the struct whose members follow in the same JSON object.
    std::string discriminator;
    std::map<std::string, const QapiType *> variants;
};

// Schema builders, for types written as constants.
QapiType qapi_of_kind(QapiType::Kind k);
// QAPI's scalars, one of each for every schema: other files' schema
// constants point at them (only their addresses are taken while statics
// are made, so the order of initialisation does not matter).
extern const QapiType kQapiStr, kQapiBool, kQapiNull, kQapiInt, kQapiUint8, kQapiUint16,
    kQapiUint32, kQapiUint64;
// QEMU's StrOrNull (migrate-set-parameters' tls-creds & co.).
extern const QapiType kQapiStrOrNull;
// The arguments of a command that takes none.
extern const QapiType kQapiNoArgs;
QapiType qapi_list_of(const QapiType *element);
QapiType qapi_enum(std::vector<std::string> values);
QapiType qapi_struct(std::vector<QapiType::Member> members);
// A flat union: `tag` (of enum `tag_type`) picks the variant whose members
// share the object.
QapiType qapi_flat_union(const char *tag, const QapiType *tag_type,
                         std::map<std::string, const QapiType *> variants);
QapiType qapi_alternate(std::string name, std::vector<const QapiType *> branches);

// Checks `value` (the member `name`) against `type`. `path` is the full
// name of `value` ("" at the top, else e.g. "channels[0]").
std::optional<QmpError> qapi_check(const json &value, const QapiType &type,
                                   const std::string &name, const std::string &path);

} // namespace qmigd
