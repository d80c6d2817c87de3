// JSON text parsed with duplicate keys found at every depth.
#include "monitor/json_parse.h"

#include <algorithm>
#include <set>

namespace qmigd {

JsonText parse_json_text(const std::string &text)
{
    using json = nlohmann::json;
    JsonText out;
    std::vector<std::set<std::string>> open; // the keys of each object being read
    auto note = [&](int depth, json::parse_event_t event, json &parsed) {
        switch (event) {
        case json::parse_event_t::object_start:
            open.emplace_back();
            break;
        case json::parse_event_t::object_end:
            if (!open.empty()) {
                open.pop_back();
            }
            break;
        case json::parse_event_t::key: {
            const auto &k = parsed.get_ref<const std::string &>();
            if (!open.empty() && !open.back().insert(k).second) {
                out.duplicate_key = true;
            }
            if (depth == 1 && std::find(out.top_keys.begin(), out.top_keys.end(), k) ==
                                  out.top_keys.end()) {
                out.top_keys.push_back(k);
            }
            break;
        }
        default:
            break;
        }
        return true;
    };
    out.value = json::parse(text, note, false);
    return out;
}

} // namespace qmigd
