// Splits a byte stream into top-level JSON texts, like QEMU's JSON
// streamer: an object or array ends at its matching bracket, anything else
// at a newline. An unterminated object produces nothing (it waits).
//
// It enforces QEMU's parser limits (qobject/json-streamer.c): nesting depth
// 1024, 64 MiB and 2 Mi tokens per text. A text over a limit yields one
// error in its place, and the rest of it is eaten until its brackets
// balance, without being buffered: no input makes the parser recurse deep
// or hold more than the limit.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace qmigd {

struct JsonPiece {
    std::string text;  // a complete JSON text, or
    std::string error; // QEMU's limit error for a text that broke one
};

class JsonSplitter {
public:
    static constexpr int kMaxNesting = 1 << 10;
    static constexpr size_t kMaxTokenSize = size_t(64) << 20;
    static constexpr size_t kMaxTokenCount = size_t(2) << 20;

    explicit JsonSplitter(size_t max_size = kMaxTokenSize) : max_size_(max_size) {}
    // Appends data; returns the complete texts (and limit errors) it closed.
    std::vector<JsonPiece> feed(const char *data, size_t len);
    size_t pending() const { return cur_.size(); }

private:
    void fail(std::vector<JsonPiece> &out, const char *what);
    void end_text(std::vector<JsonPiece> &out);

    const size_t max_size_;
    std::string cur_;
    int depth_ = 0;
    size_t tokens_ = 0;
    bool in_string_ = false;
    bool escape_ = false;
    bool in_scalar_ = false;  // inside a number or literal (one token)
    bool recovering_ = false; // over a limit: eat until brackets balance
};

} // namespace qmigd
