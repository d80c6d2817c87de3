// Multifd's zlib and zstd methods: a packet's pages compressed and decompressed.
#include "protocol/multifd_compress.h"

#include <array>
#include <cstring>

#include <fmt/format.h>
#include <zlib.h>
#include <zstd.h>

namespace qmigd {

namespace {

constexpr uint32_t kPage = TARGET_PAGE_SIZE;

// Whether a page's bytes look uniformly random (encrypted or already
// compressed data): the chi-square of its byte histogram against a uniform
// one. A random page scores 255 +- 23, text and code tens of thousands.
// deflate finds nothing in such a page whatever its level and ends up
// storing it, after spending ~10x a copy's time searching for matches.
bool looks_incompressible(const uint8_t *page)
{
    uint32_t count[256] = {};
    for (uint32_t i = 0; i < kPage; i++) {
        count[page[i]]++;
    }
    uint64_t sum_sq = 0;
    for (uint32_t c : count) {
        sum_sq += uint64_t(c) * c;
    }
    uint64_t chi2 = sum_sq * 256 / kPage - kPage;
    return chi2 < 400;
}

// --- zlib: deflate/inflate in zlib format, one stream per channel ---

class ZlibCompressor final : public MultiFDCompressor {
public:
    ~ZlibCompressor() override { deflateEnd(&zs_); }

    Status init(int level)
    {
        if (deflateInit(&zs_, level) != Z_OK) {
            return Error("deflate init failed");
        }
        level_ = current_ = level;
        return {};
    }

    Result<size_t> compress(const uint8_t *const *pages, uint32_t n, uint8_t *out,
                            size_t cap) override
    {
        zs_.next_out = out;
        zs_.avail_out = uInt(cap);
        for (uint32_t i = 0; i < n; i++) {
            // deflate may read its input more than once (stored blocks copy
            // it out, then into the window); a page the guest is writing
            // could then differ between the two. QEMU copies first too.
            std::memcpy(page_.data(), pages[i], kPage);
            QMIGD_TRY(pick_level(looks_incompressible(page_.data()) ? 0 : level_));
            zs_.next_in = page_.data();
            zs_.avail_in = kPage;
            int flush = i + 1 == n ? Z_SYNC_FLUSH : Z_NO_FLUSH;
            int ret;
            do {
                ret = deflate(&zs_, flush);
            } while (ret == Z_OK && zs_.avail_in && zs_.avail_out);
            if (ret != Z_OK) {
                return Error(fmt::format("deflate returned {} instead of Z_OK", ret));
            }
            if (zs_.avail_in || (flush == Z_SYNC_FLUSH && !zs_.avail_out)) {
                return Error("deflate failed to compress all input");
            }
        }
        return cap - zs_.avail_out;
    }

private:
    // Random-looking pages go out as stored blocks (level 0: a copy), the
    // rest at multifd-zlib-level; the stream is one zlib stream either way,
    // so any inflater, QEMU's too, reads it. Switching ends a block.
    Status pick_level(int level)
    {
        if (level == current_) {
            return {};
        }
        int ret = deflateParams(&zs_, level, Z_DEFAULT_STRATEGY);
        if (ret != Z_OK) {
            return Error(fmt::format("deflateParams returned {} instead of Z_OK", ret));
        }
        current_ = level;
        return {};
    }

    z_stream zs_{};
    int level_ = 1;   // multifd-zlib-level
    int current_ = 1; // the stream's level now
    std::array<uint8_t, kPage> page_{};
};

class ZlibDecompressor final : public MultiFDDecompressor {
public:
    ~ZlibDecompressor() override { inflateEnd(&zs_); }

    Status init()
    {
        if (inflateInit(&zs_) != Z_OK) {
            return Error("inflate init failed");
        }
        return {};
    }

    Status decompress(const uint8_t *in, size_t len, uint8_t *const *pages, uint32_t n) override
    {
        zs_.next_in = const_cast<uint8_t *>(in);
        zs_.avail_in = uInt(len);
        for (uint32_t i = 0; i < n; i++) {
            QMIGD_TRY(inflate_into(pages[i], kPage, i + 1 == n ? Z_SYNC_FLUSH : Z_NO_FLUSH));
        }
        // What is left may only be stream bookkeeping (the end of a block,
        // the flush marker), never another byte of output.
        uint8_t extra;
        zs_.next_out = &extra;
        zs_.avail_out = 1;
        int ret = inflate(&zs_, Z_SYNC_FLUSH);
        if (zs_.avail_out == 0) {
            return Error(fmt::format("packet inflates to more than its {} pages", n));
        }
        if (ret != Z_OK && ret != Z_BUF_ERROR) {
            return Error(fmt::format("inflate returned {} instead of Z_OK", ret));
        }
        return {};
    }

private:
    Status inflate_into(uint8_t *page, uInt size, int flush)
    {
        zs_.next_out = page;
        zs_.avail_out = size;
        int ret;
        do {
            ret = inflate(&zs_, flush);
        } while (ret == Z_OK && zs_.avail_in && zs_.avail_out);
        if (ret != Z_OK && !(ret == Z_BUF_ERROR && zs_.avail_out)) {
            return Error(fmt::format("inflate returned {} instead of Z_OK", ret));
        }
        if (zs_.avail_out) {
            return Error("inflate generated too few output");
        }
        return {};
    }

    z_stream zs_{};
};

// --- zstd: a streaming frame per channel that is flushed, never ended ---

class ZstdCompressor final : public MultiFDCompressor {
public:
    ~ZstdCompressor() override { ZSTD_freeCStream(cs_); }

    Status init(int level)
    {
        cs_ = ZSTD_createCStream();
        if (!cs_) {
            return Error("zstd cstream create failed");
        }
        size_t r = ZSTD_initCStream(cs_, level);
        if (ZSTD_isError(r)) {
            return Error(fmt::format("cstream init failed: {}", ZSTD_getErrorName(r)));
        }
        return {};
    }

    Result<size_t> compress(const uint8_t *const *pages, uint32_t n, uint8_t *out,
                            size_t cap) override
    {
        ZSTD_outBuffer o{out, cap, 0};
        for (uint32_t i = 0; i < n; i++) {
            // zstd copies input into its own window before it looks at it.
            ZSTD_inBuffer in{pages[i], kPage, 0};
            ZSTD_EndDirective mode = i + 1 == n ? ZSTD_e_flush : ZSTD_e_continue;
            size_t left;
            do {
                left = ZSTD_compressStream2(cs_, &o, &in, mode);
                if (ZSTD_isError(left)) {
                    return Error(fmt::format("compressStream error {}", ZSTD_getErrorName(left)));
                }
            } while ((in.pos < in.size || (mode == ZSTD_e_flush && left > 0)) && o.pos < o.size);
            if (in.pos < in.size || (mode == ZSTD_e_flush && left > 0)) {
                return Error("compressStream buffer too small");
            }
        }
        return o.pos;
    }

private:
    ZSTD_CStream *cs_ = nullptr;
};

class ZstdDecompressor final : public MultiFDDecompressor {
public:
    ~ZstdDecompressor() override { ZSTD_freeDStream(ds_); }

    Status init()
    {
        ds_ = ZSTD_createDStream();
        if (!ds_) {
            return Error("zstd dstream create failed");
        }
        size_t r = ZSTD_initDStream(ds_);
        if (ZSTD_isError(r)) {
            return Error(fmt::format("dstream init failed: {}", ZSTD_getErrorName(r)));
        }
        return {};
    }

    Status decompress(const uint8_t *in, size_t len, uint8_t *const *pages, uint32_t n) override
    {
        ZSTD_inBuffer i{in, len, 0};
        for (uint32_t k = 0; k < n; k++) {
            QMIGD_TRY(decompress_into(&i, pages[k], kPage));
        }
        // Left in the input or in zstd's buffers: block ends and flush
        // markers only, never another byte of output.
        uint8_t extra;
        ZSTD_outBuffer o{&extra, 1, 0};
        size_t r = ZSTD_decompressStream(ds_, &o, &i);
        if (ZSTD_isError(r)) {
            return Error(fmt::format("decompressStream returned {}", ZSTD_getErrorName(r)));
        }
        if (o.pos) {
            return Error(fmt::format("packet decompresses to more than its {} pages", n));
        }
        return {};
    }

private:
    Status decompress_into(ZSTD_inBuffer *in, uint8_t *page, size_t size)
    {
        ZSTD_outBuffer o{page, size, 0};
        while (o.pos < o.size) {
            size_t before_in = in->pos, before_out = o.pos;
            size_t r = ZSTD_decompressStream(ds_, &o, in);
            if (ZSTD_isError(r)) {
                return Error(fmt::format("decompressStream returned {}", ZSTD_getErrorName(r)));
            }
            if (in->pos == before_in && o.pos == before_out) {
                return Error("decompressStream buffer too small"); // input ran out
            }
        }
        return {};
    }

    ZSTD_DStream *ds_ = nullptr;
};

Result<std::unique_ptr<MultiFDCompressor>> no_compressor(int)
{
    return Error("multifd-compression none has no compressor");
}

Result<std::unique_ptr<MultiFDDecompressor>> no_decompressor()
{
    return Error("multifd-compression none has no decompressor");
}

template <typename T, typename Base, typename... Args>
Result<std::unique_ptr<Base>> make(Args... args)
{
    auto s = std::make_unique<T>();
    QMIGD_TRY(s->init(args...));
    return std::unique_ptr<Base>(std::move(s));
}

const std::array<MultiFDMethod, 3> kMethods = {{
    {MultiFDCompression::None, "none", MULTIFD_FLAG_NOCOMP, no_compressor, no_decompressor},
    {MultiFDCompression::Zlib, "zlib", MULTIFD_FLAG_ZLIB,
     make<ZlibCompressor, MultiFDCompressor, int>, make<ZlibDecompressor, MultiFDDecompressor>},
    {MultiFDCompression::Zstd, "zstd", MULTIFD_FLAG_ZSTD,
     make<ZstdCompressor, MultiFDCompressor, int>, make<ZstdDecompressor, MultiFDDecompressor>},
}};

} // namespace

const MultiFDMethod &multifd_method(MultiFDCompression c)
{
    return kMethods[size_t(c)];
}

std::optional<MultiFDCompression> multifd_compression_parse(std::string_view name)
{
    for (const auto &m : kMethods) {
        if (name == m.name) {
            return m.id;
        }
    }
    return std::nullopt;
}

} // namespace qmigd
