// StreamHandle: one libuv stream handle, TCP or unix, for the listener and the connects.
#pragma once

#include <uv.h>

#include "daemon/io/socket_address.h"

namespace qmigd {

// One libuv stream handle of either kind; which one is the owner's to know.
union StreamHandle {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
    uv_handle_t *handle() { return reinterpret_cast<uv_handle_t *>(this); }
    uv_stream_t *stream() { return reinterpret_cast<uv_stream_t *>(this); }
    // Initialises the handle for `type` with `data` as its data pointer.
    void init(uv_loop_t *loop, SocketAddress::Type type, void *data)
    {
        if (type == SocketAddress::Type::Unix) {
            uv_pipe_init(loop, &pipe, 0);
        } else {
            uv_tcp_init(loop, &tcp);
        }
        handle()->data = data;
    }
};

} // namespace qmigd
