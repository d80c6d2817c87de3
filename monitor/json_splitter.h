// Splits a byte stream into top-level JSON texts, like QEMU's JSON
// streamer: an object or array ends at its matching bracket, anything else
// at a newline. An unterminated object produces nothing (it waits).
#pragma once

#include <string>
#include <vector>

namespace qmigd {

class JsonSplitter {
public:
    // Appends data; returns the complete texts it closed.
    std::vector<std::string> feed(const char *data, size_t len);
    size_t pending() const { return cur_.size(); }

private:
    std::string cur_;
    int depth_ = 0;
    bool in_string_ = false;
    bool escape_ = false;
};

} // namespace qmigd
