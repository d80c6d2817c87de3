// Parking: the loader's park mode (blocks from the stream, device state
// kept whole), the device-state record's check, and the parked VM
// directory's record.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "daemon/park/parked_vm.h"
#include "protocol/device_state.h"
#include "protocol/loadvm.h"
#include "protocol/savevm.h"

using namespace qmigd;

std::vector<uint8_t> loadvm_test_good_stream(uint8_t fill);

namespace {

struct ParkRam : LoadvmHandler {
    std::vector<RamBlockDesc> announced;
    int announcements = 0;
    Status put_page(size_t block, uint64_t offset, const uint8_t *) override
    {
        REQUIRE(block < announced.size());
        REQUIRE(offset < announced[block].used_length);
        return {};
    }
    Status zero_page(size_t block, uint64_t) override
    {
        REQUIRE(block < announced.size());
        return {};
    }
    Status multifd_flush() override { return {}; }
    Status announce_blocks(const std::vector<RamBlockDesc> &b) override
    {
        announced = b;
        announcements++;
        return {};
    }
};

Result<LoadvmResult> park(const std::vector<uint8_t> &bytes, ParkRam &ram)
{
    LoadvmConfig cfg;
    cfg.machine_type = "something-else"; // park mode takes any machine
    cfg.park = true;
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    return qemu_loadvm_state(f, cfg, ram);
}

// Where the device sections start: the timer's FULL section header.
size_t devices_at(const std::vector<uint8_t> &s)
{
    const uint8_t pat[] = {QEMU_VM_SECTION_FULL, 0, 0, 0, 0, 5, 't', 'i', 'm', 'e', 'r'};
    auto it = std::search(s.begin(), s.end(), std::begin(pat), std::end(pat));
    REQUIRE(it != s.end());
    return size_t(it - s.begin());
}

std::string park_error(const std::vector<uint8_t> &bytes)
{
    ParkRam ram;
    auto r = park(bytes, ram);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

} // namespace

TEST_CASE("park mode takes the stream's blocks and keeps its device state whole", "[park]")
{
    auto s = loadvm_test_good_stream(0x5A);
    ParkRam ram;
    auto r = park(s, ram);
    REQUIRE(r.ok());
    CHECK(ram.announcements == 1);
    REQUIRE(ram.announced.size() == 1);
    CHECK(ram.announced[0].idstr == "mem");
    CHECK(r->machine_type == "none");
    CHECK(r->ram_section_id == 1);
    CHECK(r->normal_pages == 1);
    size_t at = devices_at(s);
    CHECK(r->device_state == std::vector<uint8_t>(s.begin() + long(at), s.end()));
    CHECK(device_state_check(r->device_state).ok());
}

TEST_CASE("park mode refuses streams it could not give back whole", "[park]")
{
    auto s = loadvm_test_good_stream(1);
    SECTION("cut inside the device state")
    {
        s.resize(s.size() - 3);
        CHECK(park_error(s) == "device state does not end with QEMU_VM_EOF and a VM description: "
                               "the stream was cut short");
    }
    SECTION("a device section before the end of RAM")
    {
        size_t at = devices_at(s);
        const uint8_t ram[] = {QEMU_VM_SECTION_START, 0, 0, 0, 1, 3, 'r', 'a', 'm'};
        auto start = std::search(s.begin(), s.end(), std::begin(ram), std::end(ram));
        std::vector<uint8_t> bad(s.begin(), start); // header + configuration
        bad.insert(bad.end(), s.begin() + long(at), s.end());
        CHECK(park_error(bad).find("a device section came before the end of RAM") == 0);
    }
    SECTION("the same block twice, or a length that is no whole pages")
    {
        std::vector<uint8_t> out;
        ByteWriter w(out);
        savevm_put_header(w);
        savevm_put_configuration(w, "pc-q35-10.0");
        savevm_put_section_header(w, QEMU_VM_SECTION_START, 2, "ram", 0, 4);
        auto twice = out;
        RamBlockDesc a[] = {{"pc.ram", 1 << 20}, {"pc.ram", 1 << 20}};
        ByteWriter w2(twice);
        ram_put_mem_size(w2, a);
        CHECK(park_error(twice) == "RAM block \"pc.ram\" announced twice");
        RamBlockDesc odd[] = {{"pc.bios", 1000}, {"pc.rom", 2 * 4096 - 1000}}; // whole total
        ram_put_mem_size(w, odd);
        CHECK(park_error(out) == "RAM block \"pc.bios\" has a bad length 0x3e8");
    }
}

TEST_CASE("a device-state record must end with EOF and a VM description", "[park]")
{
    auto s = loadvm_test_good_stream(1);
    std::vector<uint8_t> ds(s.begin() + long(devices_at(s)), s.end());
    auto ok = device_state_check(ds);
    REQUIRE(ok.ok());
    CHECK(ok->sections_bytes + 1 + 5 + ok->vmdesc_bytes == ds.size());
    for (size_t cut : {size_t(1), size_t(2), ok->vmdesc_bytes, ok->vmdesc_bytes + 5}) {
        std::vector<uint8_t> t(ds.begin(), ds.end() - long(cut));
        CHECK_FALSE(device_state_check(t).ok());
    }
    auto longer = ds;
    longer.push_back('}');
    CHECK_FALSE(device_state_check(longer).ok());
    auto nofull = ds;
    nofull[0] = QEMU_VM_SECTION_PART;
    CHECK(device_state_check(nofull).error().message() ==
          "device state does not start with a device section");
    CHECK_FALSE(device_state_check({}).ok());
}

TEST_CASE("a parked VM's directory: names, record round trip and checks", "[park]")
{
    CHECK(parked_block_path("/d", 1, "/rom@etc/acpi/tables") == "/d/01-_rom_etc_acpi_tables.img");
    CHECK(parked_block_path("/d", 0, "../x") == "/d/00-.._x.img");
    namespace fs = std::filesystem;
    fs::path dir = fs::temp_directory_path() / ("qmigd-park-unit-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directory(dir);
    auto s = loadvm_test_good_stream(1);
    ParkedVm vm;
    vm.dir = dir.string();
    vm.machine_type = "pc-q35-10.0";
    vm.ram_section_id = 7;
    vm.blocks = {{"pc.ram", 8192}, {"pc.bios", 4096}};
    vm.device_state.assign(s.begin() + long(devices_at(s)), s.end());
    CHECK(park_dir_check(vm.dir).ok());
    REQUIRE(parked_vm_write(vm).ok());
    CHECK(park_dir_check(vm.dir).error().message() == "'" + vm.dir + "' already holds a parked VM");
    CHECK(parked_vm_read(vm.dir).error().message().find("No such file or directory") !=
          std::string::npos);
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        fs::path p = parked_block_path(vm.dir, i, vm.blocks[i].idstr);
        std::ofstream(p).close();
        fs::resize_file(p, vm.blocks[i].size);
    }
    auto back = parked_vm_read(vm.dir);
    REQUIRE(back.ok());
    CHECK(back->machine_type == vm.machine_type);
    CHECK(back->ram_section_id == 7);
    CHECK(back->blocks.size() == 2);
    CHECK(back->blocks[1].idstr == "pc.bios");
    CHECK(back->device_state == vm.device_state);
    CHECK(parked_vm_ram_specs(*back)[0].path == parked_block_path(vm.dir, 0, "pc.ram"));
    fs::resize_file(parked_block_path(vm.dir, 1, "pc.bios"), 100);
    CHECK(parked_vm_read(vm.dir).error().message().find("is 100 bytes, the record says 4096") !=
          std::string::npos);
    fs::remove_all(dir);
}
