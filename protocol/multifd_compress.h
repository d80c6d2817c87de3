// Multifd compression methods (QEMU's multifd-zlib.c, multifd-zstd.c):
// what `multifd-compression` names, the packet flag each one sets, and
// the per-channel streams that turn a packet's normal pages into its
// compressed payload and back.
//
// The wire contract, as QEMU 10 keeps it: each channel has one stream for
// the whole migration; a packet's pages go in as one input each, the last
// one with a sync flush (Z_SYNC_FLUSH, ZSTD_e_flush), never a finish, so
// the receiver can inflate the packet without the next one; the packet's
// next_packet_size is the compressed byte count. Zero pages travel only as
// offsets. Every data packet, zero-only ones too, carries the method's
// flag; SYNC packets carry SYNC alone.
//
// A new method (QPL, UADK, QATzip) is one more MultiFDMethod entry.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

enum class MultiFDCompression { None, Zlib, Zstd };

// multifd-compression and its level, as a migration starts with them.
struct MultiFDCompressionParams {
    MultiFDCompression method = MultiFDCompression::None;
    int level = 1;
};

// Sender side of one channel. Not thread-safe: one per channel thread.
class MultiFDCompressor {
public:
    virtual ~MultiFDCompressor() = default;
    // Compresses pages[0..n) (n >= 1, 4 KiB each) into out[0..cap) and
    // flushes; returns the byte count. The pages may change while this
    // runs (a live guest): each page is read once, so the stream stays
    // valid and the receiver gets some version of every page.
    virtual Result<size_t> compress(const uint8_t *const *pages, uint32_t n, uint8_t *out,
                                    size_t cap) = 0;
};

// Receiver side of one channel.
class MultiFDDecompressor {
public:
    virtual ~MultiFDDecompressor() = default;
    // Inflates in[0..len) into exactly n pages, pages[i] each; anything
    // short, long or broken is an error (the packet lied about its pages).
    virtual Status decompress(const uint8_t *in, size_t len, uint8_t *const *pages,
                              uint32_t n) = 0;
};

struct MultiFDMethod {
    MultiFDCompression id;
    const char *name;  // the multifd-compression value
    uint32_t flag;     // MULTIFD_FLAG_* in bits 1..5
    // `level`: multifd-zlib-level / multifd-zstd-level; ignored by none.
    Result<std::unique_ptr<MultiFDCompressor>> (*make_compressor)(int level);
    Result<std::unique_ptr<MultiFDDecompressor>> (*make_decompressor)();
};

const MultiFDMethod &multifd_method(MultiFDCompression c);
// "none", "zlib", "zstd"; nullopt for anything else.
std::optional<MultiFDCompression> multifd_compression_parse(std::string_view name);

} // namespace qmigd
