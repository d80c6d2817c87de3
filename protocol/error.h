// qmigd's one error type: a message with context, carried as a value.
//
// Like QEMU's Error **errp, errors travel up by return value, gaining
// context on the way (prepend). Nothing here throws, so errors can cross
// thread and libuv callback boundaries as plain data.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace qmigd {

class Error {
public:
    explicit Error(std::string msg) : msg_(std::move(msg)) {}

    const std::string &message() const { return msg_; }

    // Adds context in front, like error_prepend().
    Error &prepend(std::string_view context)
    {
        msg_.insert(0, context);
        return *this;
    }

private:
    std::string msg_;
};

// Success, or an Error.
class [[nodiscard]] Status {
public:
    Status() = default;
    Status(Error err) : err_(std::move(err)) {}

    bool ok() const { return !err_; }
    explicit operator bool() const { return ok(); }
    const Error &error() const { return *err_; }

private:
    std::optional<Error> err_;
};

// A value, or an Error.
template <typename T>
class [[nodiscard]] Result {
public:
    Result(T value) : v_(std::move(value)) {}
    Result(Error err) : v_(std::move(err)) {}

    bool ok() const { return v_.index() == 0; }
    explicit operator bool() const { return ok(); }
    T &value() { return std::get<0>(v_); }
    const T &value() const { return std::get<0>(v_); }
    T &operator*() { return value(); }
    const T &operator*() const { return value(); }
    T *operator->() { return &value(); }
    const T *operator->() const { return &value(); }
    const Error &error() const { return std::get<1>(v_); }
    Status status() const { return ok() ? Status() : Status(error()); }

private:
    std::variant<T, Error> v_;
};

} // namespace qmigd

// Returns the error of a Status/Result expression from the calling function.
#define QMIGD_TRY(expr)                                                        \
    do {                                                                       \
        auto &&qmigd_try_ = (expr);                                            \
        if (!qmigd_try_.ok()) {                                                \
            return qmigd_try_.error();                                         \
        }                                                                      \
    } while (0)
