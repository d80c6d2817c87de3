// JSON text parsed as QEMU's parser reads it: a duplicate key refuses the text.
//
// nlohmann::json keeps the last of two equal keys in an object, so a
// request with `"state":"x","state":true` would run on its second value;
// QEMU answers "JSON parse error, duplicate key" and runs nothing. QMP
// requests and a parked VM's vm.json go through here.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace qmigd {

struct JsonText {
    nlohmann::json value;        // discarded (is_discarded()) when not valid JSON
    bool duplicate_key = false;  // some object repeats a key
    // The top-level object's keys in the text's order (QEMU's checks of a
    // request's members depend on it; json does not keep it).
    std::vector<std::string> top_keys;
};

JsonText parse_json_text(const std::string &text);

} // namespace qmigd
