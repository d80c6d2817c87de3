// The loader of a migration stream (protocol/loadvm.h's qemu_loadvm_state):
// shared by loadvm.cpp (header, sections, RAM) and loadvm_commands.cpp
// (COMMAND records, postcopy's among them). Internal to protocol/.
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/loadvm.h"

namespace qmigd {

enum class SectionKind { Ram, Timer, GlobalState, DirtyBitmap };

struct SectionInfo {
    SectionKind kind;
    std::string idstr;
};

// Run states a globalstate section may carry (QAPI RunState).
constexpr std::array<std::string_view, 16> kRunStates = {
    "debug",         "inmigrate",  "internal-error", "io-error",      "paused",
    "postmigrate",   "prelaunch",  "finish-migrate", "restore-vm",    "running",
    "save-vm",       "shutdown",   "suspended",      "watchdog",      "guest-panicked",
    "colo",
};

// A stream can have a handful of sections; more is a broken peer.
constexpr size_t kMaxSections = 64;
constexpr uint32_t kMaxVmDescription = 16 << 20;

// QEMU's PostcopyState on the destination; its errors print the number.
enum class PostcopyState { None = 0, Advise = 1, Discard = 2, Listening = 3, Running = 4 };

class Loader {
public:
    // `f` may be null until set_reader().
    Loader(QEMUFileReader *f, const LoadvmConfig &cfg, LoadvmHandler &h)
        : f_(f), cfg_(cfg), h_(h), blocks_(cfg.blocks)
    {
    }

    void set_reader(QEMUFileReader *f) { f_ = f; }
    Result<LoadvmResult> run();
    // After a postcopy pause: the stream goes on on `f` (no header).
    Result<LoadvmResult> resume(QEMUFileReader &f);
    // RAM records up to the first EOS (postcopy's preempt channel).
    Result<LoadvmResult> run_ram_records();
    bool in_postcopy() const { return postcopy_ == PostcopyState::Running; }

private:
    Status load_header();
    Status load_configuration();
    Status load_config_subsection();
    Status load_section_start(uint8_t type);
    Status load_section_part(uint8_t type);
    Status load_command();
    Status postcopy_advise(uint16_t len);
    Status postcopy_discard(uint16_t len);
    Status postcopy_listen();
    Status postcopy_run();
    Status load_packaged();
    Status load_main();
    Status recv_bitmap(uint16_t len);
    Status postcopy_resume();
    Status load_package(QEMUFileReader &package);
    Status park_package(const std::vector<uint8_t> &package);
    Status load_body(const SectionInfo &s, uint8_t type);
    Status check_footer(uint32_t id, const SectionInfo &s);
    Status ram_load(uint8_t type);
    Status ram_load_mem_size(uint64_t total);
    Status mapped_ram_load(size_t block, uint64_t length);
    Status load_capabilities();
    Status load_xbzrle(size_t block, uint64_t addr);
    // A non-RAM iterable section's body (dirty-bitmap), kept as it came
    // when parking.
    Status load_iterable(uint8_t type, uint32_t id, const SectionInfo &s, uint32_t instance,
                         uint32_t version);
    Status check_capabilities();
    Result<size_t> ram_block_from_stream(uint64_t flags);
    Status globalstate_load();
    Status skip_vmdesc();
    Status park_mem_size(uint64_t total);
    Status park_check_ram();
    Status park_device_state();
    Status fail(std::string msg) { return Error(std::move(msg)); }
    Status stream_status() { return f_->status(); }

    QEMUFileReader *f_; // the main channel, or a PACKAGED command's body while it loads
    const LoadvmConfig &cfg_;
    LoadvmHandler &h_;
    // The destination's blocks, or in park mode the stream's once announced.
    std::vector<RamBlockDesc> blocks_;
    bool ram_ended_ = false; // the ram section's END was read
    bool return_path_ = false; // OPEN_RETURN_PATH was read
    PostcopyState postcopy_ = PostcopyState::None;
    bool in_package_ = false; // f_ reads a PACKAGED command's body
    bool recovering_ = false; // resumed, POSTCOPY_RESUME not yet read
    std::map<uint32_t, SectionInfo> sections_;
    // CONTINUE refers to the block of the previous ZERO/PAGE record, across
    // sections (ram.c keeps it in a static for the same reason).
    std::optional<size_t> last_block_;
    bool source_mapped_ram_ = false; // configuration/capabilities listed it
    bool source_ignore_shared_ = false; // the same
    LoadvmResult result_;
    alignas(64) uint8_t page_[TARGET_PAGE_SIZE];
};

} // namespace qmigd
