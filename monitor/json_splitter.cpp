#include "monitor/json_splitter.h"

namespace qmigd {

std::vector<std::string> JsonSplitter::feed(const char *data, size_t len)
{
    std::vector<std::string> out;
    for (size_t i = 0; i < len; i++) {
        char ch = data[i];
        if (depth_ == 0 && !in_string_ && (ch == '\n' || ch == '\r')) {
            if (cur_.find_first_not_of(" \t") != std::string::npos) {
                out.push_back(std::move(cur_));
            }
            cur_.clear();
            continue;
        }
        cur_.push_back(ch);
        if (in_string_) {
            if (escape_) {
                escape_ = false;
            } else if (ch == '\\') {
                escape_ = true;
            } else if (ch == '"') {
                in_string_ = false;
            }
            continue;
        }
        if (ch == '"') {
            in_string_ = true;
        } else if (ch == '{' || ch == '[') {
            depth_++;
        } else if ((ch == '}' || ch == ']') && depth_ > 0 && --depth_ == 0) {
            out.push_back(std::move(cur_));
            cur_.clear();
        }
    }
    return out;
}

} // namespace qmigd
