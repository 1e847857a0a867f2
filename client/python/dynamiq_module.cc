// dynamiq._dynamiq: the client library (<dynamiq/client.h>) and the operator API (dynamiqctl's
// ControlClient) for Python. The package dynamiq/ re-exports it and dynamiq.torch builds the DDP
// communication hook on it; docs/python.md is the user-facing reference.
//
// Contract:
// - Every call that may block (connecting, allocating, all-reduce, waiting, operator RPCs, and the
//   teardown of a Client or Buffer) releases the GIL.
// - Shared memory is exposed without copies: Buffer.numpy() returns an ndarray over the mapping
//   whose base object holds the mapping, as does every pending all-reduce of the buffer. A Buffer
//   therefore stays mapped while any view or pending all-reduce uses it, and Buffer.release()
//   refuses (BufferError, like mmap.close()) until they are gone.
// - Errors from the client library and the daemon raise dynamiq.Error (a RuntimeError) whose str()
//   is "CODE: message", with the gRPC code name in .code and the daemon's message unchanged in
//   .message; misuse on the Python side raises ValueError, TypeError or BufferError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stddef.h>
#include <stdint.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/control_client.h"
#include "dynamiq/client.h"
#include "dynamiq/sync_state.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace py = pybind11;

namespace dynamiq::python {
namespace {

// A failed absl::Status on its way to the exception translator.
class StatusException : public std::exception {
 public:
  explicit StatusException(absl::Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

void Check(absl::Status status) {
  if (!status.ok()) throw StatusException(std::move(status));
}

// Runs `fn` without the GIL when this thread holds it and the interpreter is not shutting down
// (teardown may block on the daemon for seconds; other Python threads must keep running).
template <typename Fn>
void WithoutGil(Fn&& fn) {
  if (Py_IsInitialized() && !_Py_IsFinalizing() && PyGILState_Check()) {
    py::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

// Parses a dtype given as dynamiq.DType, a string ("float32", "bfloat16", "torch.bfloat16", ...) or
// anything whose str() is one of those (numpy and torch dtypes).
DType ParseDType(py::handle dtype) {
  if (py::isinstance<DType>(dtype)) return dtype.cast<DType>();
  std::string name = py::str(dtype);
  if (absl::string_view(name).substr(0, 6) == "torch.") name = name.substr(6);
  if (name == "float32" || name == "float" || name == "fp32" || name == "<class 'numpy.float32'>") {
    return DType::kFloat32;
  }
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  throw py::type_error(absl::StrCat("dynamiq all-reduces float32 or bfloat16, not ", name,
                                    " (convert the data first; the daemon accumulates in fp32)"));
}

// A numpy dtype's or array's item size through its Python attribute: pybind11 2.10 reads it from the
// dtype struct, whose layout numpy 2 changed (it reads 0 there, and the division by it is SIGFPE).
size_t ItemSize(py::handle dtype_or_array) { return dtype_or_array.attr("itemsize").cast<size_t>(); }

// The numpy dtype of a view: any numpy dtype, or bfloat16 as its raw bits (numpy has none).
py::dtype NumpyDType(py::handle dtype) {
  if (py::isinstance<DType>(dtype)) {
    return py::dtype(dtype.cast<DType>() == DType::kBFloat16 ? "uint16" : "float32");
  }
  if (py::isinstance<py::str>(dtype)) {
    const std::string name = dtype.cast<std::string>();
    if (name == "bfloat16" || name == "bf16") return py::dtype("uint16");
  }
  return py::dtype::from_args(py::reinterpret_borrow<py::object>(dtype));
}

std::string ClientCodeName(absl::StatusCode code) { return absl::StatusCodeToString(code); }

py::object ProtoToPy(const google::protobuf::Message& message);

// One field of a message (element `index` of a repeated field, or -1).
py::object FieldToPy(const google::protobuf::Message& m, const google::protobuf::FieldDescriptor* f, int index) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return py::int_(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return py::int_(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return py::int_(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return py::int_(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return py::float_(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return py::float_(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return py::bool_(rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f));
    case FieldDescriptor::CPPTYPE_ENUM:
      return py::str(rep ? r->GetRepeatedEnum(m, f, index)->name() : r->GetEnum(m, f)->name());
    case FieldDescriptor::CPPTYPE_STRING:
      return py::str(rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f));
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToPy(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
  }
  return py::none();
}

// A message as a dict keyed by the .proto field names, every field present (proto3 defaults
// included; unset optional fields are None), so answers of newer daemons carry their new fields.
py::object ProtoToPy(const google::protobuf::Message& message) {
  const google::protobuf::Descriptor* d = message.GetDescriptor();
  const google::protobuf::Reflection* r = message.GetReflection();
  py::dict out;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      py::list items;
      for (int k = 0; k < r->FieldSize(message, f); ++k) items.append(FieldToPy(message, f, k));
      out[py::str(f->name())] = items;
    } else if (f->has_presence() && !r->HasField(message, f) && f->cpp_type() != f->CPPTYPE_MESSAGE) {
      out[py::str(f->name())] = py::none();
    } else {
      out[py::str(f->name())] = FieldToPy(message, f, -1);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Buffer

constexpr char kBufferCapsule[] = "dynamiq.Buffer";

using BufferRef = std::shared_ptr<Buffer>;

BufferRef MakeBufferRef(Buffer buffer) {
  return BufferRef(new Buffer(std::move(buffer)), [](Buffer* b) { WithoutGil([b] { delete b; }); });
}

// Elements of `item` bytes in the region of `b` that a view asks for (`count`, default: all that
// fit after `offset_bytes`); ValueError if the offset is misaligned or the region does not fit.
size_t RegionElements(const Buffer& b, size_t item, std::optional<size_t> count, size_t offset_bytes) {
  if (offset_bytes % item != 0 || offset_bytes > b.size()) {
    throw py::value_error(absl::StrCat("offset_bytes ", offset_bytes, " must be a multiple of ", item,
                                       " within the buffer's ", b.size(), " bytes"));
  }
  const size_t fits = (b.size() - offset_bytes) / item;
  const size_t n = count.value_or(fits);
  if (n > fits) {
    throw py::value_error(absl::StrCat(n, " elements of ", item, " bytes at offset ", offset_bytes,
                                       " do not fit in the buffer's ", b.size(), " bytes"));
  }
  return n;
}

// A capsule owning one more reference to `b`: a view's base keeps the buffer mapped (and counts
// in its users()).
py::capsule Owner(const BufferRef& b) {
  return py::capsule(new BufferRef(b), kBufferCapsule,
                     [](PyObject* o) { delete static_cast<BufferRef*>(PyCapsule_GetPointer(o, kBufferCapsule)); });
}

// The Python Buffer: the mapping is shared with every view and pending all-reduce (use_count).
class PyBuffer {
 public:
  explicit PyBuffer(BufferRef buffer) : buffer_(std::move(buffer)) {}

  const BufferRef& ref() const {
    if (buffer_ == nullptr || !buffer_->valid()) throw py::value_error("the dynamiq Buffer was released");
    return buffer_;
  }
  size_t size() const { return buffer_ == nullptr ? 0 : buffer_->size(); }
  uint64_t id() const { return buffer_ == nullptr ? 0 : buffer_->id(); }
  bool valid() const { return buffer_ != nullptr && buffer_->valid(); }
  // Extra owners of the mapping: live views and pending all-reduces.
  long users() const { return buffer_ == nullptr ? 0 : buffer_.use_count() - 1; }

  py::array Numpy(py::object dtype, std::optional<size_t> count, size_t offset_bytes) const {
    const BufferRef& b = ref();
    if (b->data() == nullptr) {
      throw py::value_error("a CUDA device buffer has no host memory to view: use Buffer.cuda_array()");
    }
    const py::dtype np_dtype = NumpyDType(dtype);
    const size_t item = ItemSize(np_dtype);
    const size_t n = RegionElements(*b, item, count, offset_bytes);
    return py::array(np_dtype, {static_cast<py::ssize_t>(n)}, {static_cast<py::ssize_t>(item)},
                     static_cast<uint8_t*>(b->data()) + offset_bytes, Owner(b));
  }

  std::string memory() const {
    return buffer_ != nullptr && buffer_->memory_kind() == MemoryKind::kCudaDevice ? "cuda" : "host";
  }
  int device() const { return buffer_ == nullptr ? -1 : buffer_->device(); }

  // A device buffer's region as an object with __cuda_array_interface__ (version 3), which keeps
  // the buffer mapped while it lives: torch.as_tensor(buffer.cuda_array(...), device="cuda:N").
  py::object CudaArray(const std::string& dtype, std::optional<size_t> count, size_t offset_bytes) const {
    const BufferRef& b = ref();
    if (b->device_data() == nullptr) throw py::value_error("cuda_array() of a host buffer: use Buffer.numpy()");
    size_t item = 0;
    std::string typestr;
    if (dtype == "float32") {
      item = 4, typestr = "<f4";
    } else if (dtype == "int16") {  // bfloat16 bits: no typestr for bfloat16
      item = 2, typestr = "<i2";
    } else {
      throw py::value_error(absl::StrCat("cuda_array dtype '", dtype, "': float32 or int16 (bfloat16 bits)"));
    }
    const size_t n = RegionElements(*b, item, count, offset_bytes);
    py::dict interface;
    interface["shape"] = py::make_tuple(n);
    interface["typestr"] = typestr;
    interface["data"] =
        py::make_tuple(reinterpret_cast<uintptr_t>(static_cast<uint8_t*>(b->device_data()) + offset_bytes), false);
    interface["version"] = 3;
    interface["strides"] = py::none();
    interface["stream"] = py::none();  // the writes are complete when an all-reduce returns
    py::object holder = py::module_::import("types").attr("SimpleNamespace")();
    holder.attr("__cuda_array_interface__") = interface;
    holder.attr("_owner") = Owner(b);
    holder.attr("device") = b->device();
    return holder;
  }

  void Release() {
    if (buffer_ == nullptr) return;
    if (users() > 0) {
      throw py::buffer_error(absl::StrCat("cannot release dynamiq buffer ", buffer_->id(), ": ", users(),
                                          " array views or pending all-reduces still use it"));
    }
    BufferRef b = std::move(buffer_);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = b->Release();
    }
    Check(std::move(status));
  }

 private:
  BufferRef buffer_;
};

// The buffer and byte offset an ndarray view of a Buffer starts at: walks the array's base chain to
// the capsule Buffer.numpy() made. Throws ValueError for an array that is not such a view.
std::pair<BufferRef, size_t> FindBufferOfArray(const py::array& array) {
  if (!(array.flags() & py::array::c_style)) throw py::value_error("all-reduce of a non-contiguous array");
  py::object base = array.attr("base");
  for (int depth = 0; depth < 64 && !base.is_none(); ++depth) {
    if (py::isinstance<py::capsule>(base)) {
      py::capsule capsule = py::reinterpret_borrow<py::capsule>(base);
      if (capsule.name() != nullptr && std::string(capsule.name()) == kBufferCapsule) {
        const BufferRef* ref = capsule;
        const BufferRef& b = *ref;
        const auto* start = static_cast<const uint8_t*>(array.data());
        const auto* begin = static_cast<const uint8_t*>(b->data());
        if (start < begin || start + array.nbytes() > begin + b->size()) break;
        return {b, static_cast<size_t>(start - begin)};
      }
      break;
    }
    if (!py::hasattr(base, "base")) break;
    base = base.attr("base");
  }
  throw py::value_error(
      "all-reduce of an array that is not a view of a dynamiq Buffer (use Buffer.numpy(), or pass the Buffer)");
}

// ---------------------------------------------------------------------------------------------
// Future

class PyFuture {
 public:
  PyFuture(Future future, BufferRef keepalive) : future_(std::move(future)), keepalive_(std::move(keepalive)) {}

  bool Done() {
    const bool ready = future_.Ready();
    if (ready) keepalive_.reset();
    return ready;
  }

  AllReduceResult Wait() {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = future_.Wait();
    }
    keepalive_.reset();
    Check(std::move(status));
    return future_.result();
  }

 private:
  Future future_;
  BufferRef keepalive_;  // the buffer stays mapped until the daemon is done with it
};

// ---------------------------------------------------------------------------------------------
// Client

// The C++ client names its settings as C++ does (ClientOptions::socket_path); a Python caller gave
// them as dynamiq.Client's arguments.
absl::Status PythonNames(const absl::Status& status) {
  if (status.ok()) return status;
  const std::string message =
      absl::StrReplaceAll(status.message(), {{"ClientOptions::socket_path", "socket"},
                                             {"ClientOptions::job_id", "job"},
                                             {"ClientOptions::local_rank", "local_rank"},
                                             {"ClientOptions::local_world_size", "local_world_size"},
                                             {"ClientOptions::timeout", "timeout"}});
  return absl::Status(status.code(), message);
}

class PyClient {
 public:
  PyClient(std::optional<std::string> socket, std::optional<std::string> job, std::optional<uint32_t> local_rank,
           std::optional<uint32_t> local_world_size, std::optional<double> timeout) {
    ClientOptions options;  // DQ_* defaults
    if (socket) options.socket_path = *socket;
    if (job) options.job_id = *job;
    if (local_rank) options.local_rank = *local_rank;
    if (local_world_size) options.local_world_size = *local_world_size;
    if (timeout) options.timeout = absl::Seconds(*timeout);
    absl::StatusOr<Client> client;
    {
      py::gil_scoped_release release;
      client = Client::Connect(options);
    }
    Check(PythonNames(client.status()));
    client_ = std::shared_ptr<Client>(new Client(*std::move(client)), [](Client* c) { WithoutGil([c] { delete c; }); });
  }

  const std::shared_ptr<Client>& client() const {
    if (client_ == nullptr) throw py::value_error("the dynamiq Client is closed");
    return client_;
  }

  PyBuffer Allocate(size_t bytes, const std::string& memory) {
    std::shared_ptr<Client> c = client();
    if (memory != "host" && memory != "cuda") {
      throw py::value_error(absl::StrCat("memory '", memory, "': host or cuda"));
    }
    const MemoryKind kind = memory == "cuda" ? MemoryKind::kCudaDevice : MemoryKind::kHost;
    absl::StatusOr<Buffer> buffer;
    {
      py::gil_scoped_release release;
      buffer = c->Allocate(bytes, kind);
    }
    Check(buffer.status());
    return PyBuffer(MakeBufferRef(*std::move(buffer)));
  }

  // The region an all-reduce names: a Buffer with count/offset, or an ndarray view of one.
  struct Region {
    BufferRef buffer;
    size_t offset_bytes = 0;
    size_t count = 0;
    DType dtype = DType::kFloat32;
  };

  static Region ResolveRegion(py::handle target, std::optional<size_t> count, size_t offset_bytes, py::object dtype) {
    Region r;
    if (py::isinstance<PyBuffer>(target)) {
      const PyBuffer& b = target.cast<const PyBuffer&>();
      r.buffer = b.ref();
      r.dtype = dtype.is_none() ? DType::kFloat32 : ParseDType(dtype);
      r.offset_bytes = offset_bytes;
      if (!count) throw py::value_error("all-reduce of a Buffer needs count (elements)");
      r.count = *count;
      return r;
    }
    if (py::isinstance<py::array>(target)) {
      py::array a = py::reinterpret_borrow<py::array>(target);
      if (count || offset_bytes != 0) {
        throw py::value_error("all-reduce of an array view takes its size and offset from the array");
      }
      std::tie(r.buffer, r.offset_bytes) = FindBufferOfArray(a);
      const std::string kind = py::str(a.dtype());
      if (!dtype.is_none()) {
        r.dtype = ParseDType(dtype);
      } else if (kind == "float32") {
        r.dtype = DType::kFloat32;
      } else {
        throw py::type_error(absl::StrCat("all-reduce of a ", kind,
                                          " array: float32 views carry their type; for bfloat16 views (uint16 "
                                          "bits) pass dtype=dynamiq.bfloat16"));
      }
      if (ItemSize(a) != DTypeSize(r.dtype)) {
        throw py::type_error(absl::StrCat("array of ", kind, " is not a ", DTypeName(r.dtype), " view"));
      }
      r.count = static_cast<size_t>(a.size());
      return r;
    }
    throw py::type_error("all-reduce needs a dynamiq.Buffer or an ndarray view of one (Buffer.numpy())");
  }

  AllReduceResult AllReduce(py::handle target, const std::string& name, std::optional<size_t> count,
                            size_t offset_bytes, py::object dtype, bool average, std::optional<double> weight) {
    std::shared_ptr<Client> c = client();
    Region r = ResolveRegion(target, count, offset_bytes, std::move(dtype));
    AllReduceResult result;
    absl::Status status;
    {
      py::gil_scoped_release release;
      status =
          c->AllReduce(*r.buffer, r.offset_bytes, r.count, r.dtype, name, AllReduceOptions{average, weight}, &result);
    }
    Check(std::move(status));
    return result;
  }

  PyFuture AllReduceAsync(py::handle target, const std::string& name, std::optional<size_t> count, size_t offset_bytes,
                          py::object dtype, bool average, std::optional<double> weight) {
    std::shared_ptr<Client> c = client();
    Region r = ResolveRegion(target, count, offset_bytes, std::move(dtype));
    Future future;
    {
      // Submission is non-blocking in the library, but gRPC may take locks: let other threads run.
      py::gil_scoped_release release;
      future = c->AllReduceAsync(*r.buffer, r.offset_bytes, r.count, r.dtype, name, AllReduceOptions{average, weight});
    }
    return PyFuture(std::move(future), std::move(r.buffer));
  }

  py::dict SyncState(const PyBuffer& buffer, size_t num_bytes, uint64_t rank, uint64_t world, size_t offset_bytes,
                     const std::string& name) {
    std::shared_ptr<Client> c = client();
    const BufferRef& b = buffer.ref();
    absl::StatusOr<SyncStateResult> r;
    {
      py::gil_scoped_release release;
      r = dynamiq::SyncState(*c, *b, offset_bytes, num_bytes, SyncStateOptions{rank, world, name});
    }
    Check(r.status());
    py::dict out;
    out["copied"] = r->copied;
    out["source"] = r->source;
    out["agreeing"] = r->agreeing;
    out["hash"] = r->hash;
    return out;
  }

  void Close() {
    std::shared_ptr<Client> c = std::move(client_);
    // The deleter releases the GIL while ~Client waits for in-flight work and unregisters.
    c.reset();
  }

  bool closed() const { return client_ == nullptr; }

 private:
  std::shared_ptr<Client> client_;
};

// ---------------------------------------------------------------------------------------------
// Control

class PyControl {
 public:
  PyControl(const std::string& address, double timeout, std::optional<std::string> token,
            std::optional<std::string> token_file, std::optional<std::string> tls_ca)
      : client_(Options(address, timeout, std::move(token), std::move(token_file), std::move(tls_ca))) {}

  py::object Status() {
    absl::StatusOr<dynamiq::v1::GetStatusResponse> s;
    {
      py::gil_scoped_release release;
      s = client_.GetStatus();
    }
    Check(s.status());
    return ProtoToPy(*s);
  }

  uint64_t SetCompression(const std::string& job, std::optional<std::string> codec, std::optional<double> bits,
                          std::optional<std::string> topology, std::optional<uint64_t> min_compress_elements,
                          std::optional<std::string> allocator, std::optional<double> target_vnmse,
                          std::optional<double> min_bits, std::optional<double> max_bits,
                          std::optional<double> sample_rate, std::optional<uint64_t> expected_epoch,
                          std::optional<double> lossy_phase_ms) {
    ctl::CompressionChange change;
    change.job_id = job;
    change.codec = std::move(codec);
    change.bits = bits;
    change.topology = std::move(topology);
    change.min_compress_elements = min_compress_elements;
    change.allocator = std::move(allocator);
    change.target_vnmse = target_vnmse;
    change.min_bits = min_bits;
    change.max_bits = max_bits;
    change.sample_rate = sample_rate;
    change.expected_epoch = expected_epoch;
    change.lossy_phase_ms = lossy_phase_ms;
    absl::StatusOr<ctl::CompressionChangeResult> result;
    {
      py::gil_scoped_release release;
      result = ctl::ChangeCompression(client_, change);
    }
    Check(result.status());
    return result->epoch;
  }

  py::object FlightRecorder(const std::string& job, uint32_t limit) {
    absl::StatusOr<dynamiq::v1::GetFlightRecorderResponse> r;
    {
      py::gil_scoped_release release;
      r = client_.GetFlightRecorder(job, limit);
    }
    Check(r.status());
    return ProtoToPy(*r)["records"];
  }

  const std::string& address() const { return client_.options().daemon; }

 private:
  // An explicit token wins over token_file, which wins over $DQ_TOKEN_FILE (as for dynamiqctl).
  static ctl::ConnectOptions Options(const std::string& address, double timeout, std::optional<std::string> token,
                                     std::optional<std::string> token_file, std::optional<std::string> tls_ca) {
    ctl::ConnectOptions o;
    o.daemon = address;
    o.timeout = absl::Seconds(timeout);
    std::string file = token_file.value_or("");
    const char* file_name = "token_file";  // errors name the argument (or variable) it came from
    if (const char* env = std::getenv("DQ_TOKEN_FILE"); file.empty() && !token && env != nullptr) {
      file = env;
      file_name = "DQ_TOKEN_FILE";
    }
    Check(ctl::LoadCredentials(token ? "" : file, tls_ca.value_or(""), o, file_name, "tls_ca"));
    if (token) o.token = *std::move(token);
    return o;
  }

  ctl::ControlClient client_;
};

std::string ResultRepr(const AllReduceResult& r) {
  return absl::StrCat("AllReduceResult(sequence=", r.sequence, ", config_epoch=", r.config_epoch, ", codec='", r.codec,
                      "', bits=", r.bits, ", wire_bytes=", r.wire_bytes,
                      ", measured_vnmse=", r.measured_vnmse.has_value() ? absl::StrCat(*r.measured_vnmse) : "None",
                      ", contributors=", r.contributors, ", weight_sum=", r.weight_sum, ")");
}

}  // namespace
}  // namespace dynamiq::python

PYBIND11_MODULE(_dynamiq, m) {
  using namespace dynamiq;          // NOLINT(build/namespaces): module definition only
  using namespace dynamiq::python;  // NOLINT(build/namespaces)
  m.doc() = "dynamiq client: shared-memory buffers and all-reduce through the node's dynamiqd (see docs/python.md)";

  // pybind11 (2.10) sets up its numpy API on first use under a C++ static guard that it holds across
  // a Python import, which lets go of the GIL: two threads making their first Buffer.numpy() call at
  // once deadlock (one holds the guard and waits for the GIL, the other holds the GIL and waits for
  // the guard; seen with numpy 2, whose import is slower). Set it up here, at import, on one thread.
  try {
    (void)py::dtype::of<float>();
  } catch (const py::error_already_set&) {
    // No numpy: Buffer.numpy() raises its ImportError when called.
  }

  static py::exception<StatusException> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      const std::string code = ClientCodeName(e.status().code());
      const std::string message(e.status().message());
      py::object exc = py::handle(error.ptr())(absl::StrCat(code, ": ", message));
      exc.attr("code") = code;
      exc.attr("message") = message;
      PyErr_SetObject(error.ptr(), exc.ptr());
    }
  });

  py::enum_<DType>(m, "DType", "Element type of an all-reduced region (the daemon accumulates in fp32).")
      .value("float32", DType::kFloat32)
      .value("bfloat16", DType::kBFloat16);
  m.attr("float32") = DType::kFloat32;
  m.attr("bfloat16") = DType::kBFloat16;

  py::class_<CompressionConfig>(m, "CompressionConfig", "A job's compression as the daemon reported it.")
      .def_readonly("codec", &CompressionConfig::codec)
      .def_readonly("bits", &CompressionConfig::bits)
      .def_readonly("topology", &CompressionConfig::topology)
      .def_readonly("min_compress_elements", &CompressionConfig::min_compress_elements)
      .def_readonly("allocator", &CompressionConfig::allocator)
      .def("__repr__", [](const CompressionConfig& c) {
        return absl::StrCat("CompressionConfig(codec='", c.codec, "', bits=", c.bits, ", topology='", c.topology,
                            "', min_compress_elements=", c.min_compress_elements, ", allocator='", c.allocator, "')");
      });

  py::class_<AllReduceResult>(m, "AllReduceResult", "What the daemon reported about a completed all-reduce.")
      .def_readonly("sequence", &AllReduceResult::sequence)
      .def_readonly("config_epoch", &AllReduceResult::config_epoch)
      .def_readonly("codec", &AllReduceResult::codec)
      .def_readonly("bits", &AllReduceResult::bits)
      .def_readonly("wire_bytes", &AllReduceResult::wire_bytes)
      .def_readonly("measured_vnmse", &AllReduceResult::measured_vnmse,
                    "vNMSE the daemon measured for this collective (its error probe, dynamiqd "
                    "--error_sample_rate), or None when it did not sample it")
      .def_readonly("contributors", &AllReduceResult::contributors,
                    "The workers of every node whose values were summed")
      .def_readonly("weight_sum", &AllReduceResult::weight_sum,
                    "The sum of the contributors' weights (without weights, their number)")
      .def_readonly("nodes", &AllReduceResult::nodes,
                    "The nodes whose workers took part (fewer than every node once some left the job's group)")
      .def("__repr__", &ResultRepr);

  py::class_<PyBuffer>(m, "Buffer", "Shared memory mapped by this process and dynamiqd (Client.allocate).")
      .def_property_readonly("size", &PyBuffer::size, "Usable bytes (at least what was asked).")
      .def_property_readonly("id", &PyBuffer::id)
      .def_property_readonly("valid", &PyBuffer::valid)
      .def_property_readonly("memory", &PyBuffer::memory, "'host' (shared memory) or 'cuda' (a device buffer).")
      .def_property_readonly("device", &PyBuffer::device, "CUDA device ordinal of a device buffer; -1 otherwise.")
      .def("cuda_array", &PyBuffer::CudaArray, py::arg("dtype") = "float32", py::arg("count") = py::none(),
           py::arg("offset_bytes") = 0,
           "A device buffer's region as an object with __cuda_array_interface__ that keeps the buffer mapped: "
           "torch.as_tensor(b.cuda_array(), device=f'cuda:{b.device}'). dtype float32 or int16 (bfloat16 bits).")
      .def_property_readonly("users", &PyBuffer::users, "Live array views and pending all-reduces of the buffer.")
      .def("numpy", &PyBuffer::Numpy, py::arg("dtype") = "float32", py::arg("count") = py::none(),
           py::arg("offset_bytes") = 0,
           "A 1-D ndarray over the shared memory (no copy). dtype: any numpy dtype, or 'bfloat16' (uint16 bits). "
           "count: elements (default: as many as fit).")
      .def("release", &PyBuffer::Release,
           "Frees the buffer in the daemon and unmaps it. BufferError while views or all-reduces use it.")
      .def("__len__", &PyBuffer::size)
      .def("__repr__", [](const PyBuffer& b) {
        return absl::StrCat("dynamiq.Buffer(id=", b.id(), ", size=", b.size(), b.valid() ? "" : ", released", ")");
      });

  py::class_<PyFuture>(m, "Future", "A pending asynchronous all-reduce (Client.all_reduce_async).")
      .def("done", &PyFuture::Done, "True once wait() would not block.")
      .def("wait", &PyFuture::Wait,
           "Blocks (without the GIL) until the result is in the buffer; returns the AllReduceResult or raises "
           "dynamiq.Error with the daemon's message. May be called again.");

  py::class_<PyClient>(m, "Client", "One worker's registration with its node's dynamiqd.")
      .def(py::init<std::optional<std::string>, std::optional<std::string>, std::optional<uint32_t>,
                    std::optional<uint32_t>, std::optional<double>>(),
           py::arg("socket") = py::none(), py::arg("job") = py::none(), py::arg("local_rank") = py::none(),
           py::arg("local_world_size") = py::none(), py::arg("timeout") = py::none(),
           "Connects and registers. Unset arguments come from DQ_SOCKET, DQ_JOB, DQ_LOCAL_RANK, "
           "DQ_LOCAL_WORLD_SIZE, DQ_TIMEOUT_SECONDS (timeout in seconds); DQ_SUBMISSION_RING=0 makes every "
           "all-reduce a gRPC call instead of a submission through shared memory.")
      .def("allocate", &PyClient::Allocate, py::arg("bytes"), py::arg("memory") = "host",
           "A Buffer of at least `bytes` bytes: memory='host' shared memory (Buffer.numpy()); 'cuda' memory of "
           "a --device=cuda daemon's GPU opened through CUDA IPC (Buffer.cuda_array(); FAILED_PRECONDITION "
           "from a --device=cpu daemon).")
      .def("all_reduce", &PyClient::AllReduce, py::arg("target"), py::arg("name"), py::kw_only(),
           py::arg("count") = py::none(), py::arg("offset_bytes") = 0, py::arg("dtype") = py::none(),
           py::arg("average") = false, py::arg("weight") = py::none(),
           "All-reduces in place and returns the AllReduceResult. target: a Buffer (with count, offset_bytes, "
           "dtype) or an ndarray view of one (Buffer.numpy()). weight: this worker's weight (its sample count, "
           ">= 0): the result is sum(w_i g_i), with average divided by sum(w_i); every worker of a collective "
           "gives one or none does. Blocks without the GIL.")
      .def("all_reduce_async", &PyClient::AllReduceAsync, py::arg("target"), py::arg("name"), py::kw_only(),
           py::arg("count") = py::none(), py::arg("offset_bytes") = 0, py::arg("dtype") = py::none(),
           py::arg("average") = false, py::arg("weight") = py::none(), "Like all_reduce, but returns a Future at once.")
      .def("sync_state", &PyClient::SyncState, py::arg("buffer"), py::arg("num_bytes"), py::kw_only(), py::arg("rank"),
           py::arg("world"), py::arg("offset_bytes") = 0, py::arg("name") = "state",
           "Makes num_bytes bytes of the buffer identical on every worker of the job: the state most workers "
           "hold, from its lowest rank, copied bit for bit to those whose bytes differ (uncompressed, whatever the "
           "job's codec). Every worker calls it alike (rank: its own of world). Returns {copied, source, agreeing, "
           "hash}. Blocks without the GIL.")
      .def("close", &PyClient::Close,
           "Waits for in-flight all-reduces and unregisters; later calls raise ValueError. Idempotent.")
      .def_property_readonly("closed", &PyClient::closed)
      .def_property_readonly("worker_id", [](const PyClient& c) { return c.client()->worker_id(); })
      .def_property_readonly("node_rank", [](const PyClient& c) { return c.client()->node_rank(); })
      .def_property_readonly("num_nodes", [](const PyClient& c) { return c.client()->num_nodes(); })
      .def_property_readonly("config_epoch", [](const PyClient& c) { return c.client()->config_epoch(); })
      .def_property_readonly("config", [](const PyClient& c) { return c.client()->config(); })
      .def_property_readonly(
          "daemon_device",
          [](const PyClient& c) { return c.client()->daemon_device() == DeviceKind::kCuda ? "cuda" : "cpu"; },
          "Where the daemon reduces (its --device): 'cuda' daemons also hand out device buffers.")
      .def_property_readonly(
          "uses_submission_ring", [](const PyClient& c) { return c.client()->uses_submission_ring(); },
          "True when all-reduces go through the submission ring in shared memory (no gRPC call each); "
          "DQ_SUBMISSION_RING=0 turns it off.")
      .def_property_readonly("socket", [](const PyClient& c) { return c.client()->options().socket_path; })
      .def_property_readonly("job", [](const PyClient& c) { return c.client()->options().job_id; })
      .def_property_readonly("local_rank", [](const PyClient& c) { return c.client()->options().local_rank; })
      .def_property_readonly("local_world_size",
                             [](const PyClient& c) { return c.client()->options().local_world_size; })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyClient& c, py::args) { c.Close(); });

  py::class_<PyControl>(m, "Control", "dynamiqd's operator API (what dynamiqctl calls), on its --listen address.")
      .def(py::init<const std::string&, double, std::optional<std::string>, std::optional<std::string>,
                    std::optional<std::string>>(),
           py::arg("address"), py::arg("timeout") = 10.0, py::kw_only(), py::arg("token") = py::none(),
           py::arg("token_file") = py::none(), py::arg("tls_ca") = py::none(),
           "Connects to dynamiqd's --listen address. token: the operator token (dynamiqd --operator_token_file); "
           "token_file: a file holding it (mode 0600; default $DQ_TOKEN_FILE); tls_ca: PEM CA file to verify the "
           "daemon's TLS certificate with (turns TLS on).")
      .def_property_readonly("address", &PyControl::address)
      .def("status", &PyControl::Status,
           "GetStatus as a dict keyed by the .proto field names (node, members, jobs with their configuration).")
      .def("set_compression", &PyControl::SetCompression, py::arg("job"), py::kw_only(), py::arg("codec") = py::none(),
           py::arg("bits") = py::none(), py::arg("topology") = py::none(),
           py::arg("min_compress_elements") = py::none(), py::arg("allocator") = py::none(),
           py::arg("target_vnmse") = py::none(), py::arg("min_bits") = py::none(), py::arg("max_bits") = py::none(),
           py::arg("sample_rate") = py::none(), py::arg("expected_epoch") = py::none(),
           py::arg("lossy_phase_ms") = py::none(),
           "Changes a job's compression like `dynamiqctl set-compression` (unset fields keep the job's values; "
           "target_vnmse puts the job under an error budget, docs/error_budget.md; lossy_phase_ms > 0 the "
           "loss-tolerant all-reduce on dynamiqd --transport=udp nodes); returns the config epoch at which it "
           "applies on every node.")
      .def("flight_recorder", &PyControl::FlightRecorder, py::arg("job") = "", py::arg("limit") = 0,
           "The daemon's recent collectives (CollectiveRecord dicts, oldest first).");
}
