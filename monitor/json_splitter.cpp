// The JSON stream splitter: top-level texts out of a byte stream, with QEMU's limits.
#include "monitor/json_splitter.h"

namespace qmigd {

namespace {

bool is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r';
}

bool is_structural(char ch)
{
    return ch == '{' || ch == '}' || ch == '[' || ch == ']' || ch == ',' || ch == ':';
}

} // namespace

void JsonSplitter::fail(std::vector<JsonPiece> &out, const char *what)
{
    out.push_back({{}, what});
    cur_.clear();
    cur_.shrink_to_fit();
    recovering_ = true;
}

void JsonSplitter::end_text(std::vector<JsonPiece> &out)
{
    if (!recovering_ && cur_.find_first_not_of(" \t\r\n") != std::string::npos) {
        out.push_back({std::move(cur_), {}});
    }
    cur_.clear();
    depth_ = 0;
    tokens_ = 0;
    in_scalar_ = false;
    recovering_ = false;
}

std::vector<JsonPiece> JsonSplitter::feed(const char *data, size_t len)
{
    std::vector<JsonPiece> out;
    for (size_t i = 0; i < len; i++) {
        char ch = data[i];
        if (depth_ == 0 && !in_string_ && (ch == '\n' || ch == '\r')) {
            end_text(out);
            continue;
        }
        if (!recovering_) {
            cur_.push_back(ch);
        }
        if (in_string_) {
            if (escape_) {
                escape_ = false;
            } else if (ch == '\\') {
                escape_ = true;
            } else if (ch == '"') {
                in_string_ = false;
            }
        } else if (ch == '"') {
            in_string_ = true;
            in_scalar_ = false;
            tokens_++;
        } else if (is_structural(ch) || is_space(ch)) {
            in_scalar_ = false;
            tokens_ += !is_space(ch);
            if (ch == '{' || ch == '[') {
                depth_++;
            } else if ((ch == '}' || ch == ']') && depth_ > 0 && --depth_ == 0) {
                end_text(out);
                continue;
            }
        } else if (!in_scalar_) {
            in_scalar_ = true;
            tokens_++;
        }
        if (recovering_) {
            continue;
        }
        if (cur_.size() > max_size_) {
            fail(out, "JSON token size limit exceeded");
        } else if (tokens_ > kMaxTokenCount) {
            fail(out, "JSON token count limit exceeded");
        } else if (depth_ > kMaxNesting) {
            fail(out, "JSON nesting depth limit exceeded");
        }
    }
    return out;
}

} // namespace qmigd
