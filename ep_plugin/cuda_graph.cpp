// The graph the package captures and owns: a CUgraph read in one topological
// order, searched for the addresses its nodes' parameters hold, given host-to-device
// copies and host-computed MatMuls (a D2H copy, a host node, an H2D copy each), then
// instantiated and replayed on a CUDA stream.
#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cuda_objects.h"
#include "host_matmul.h"

namespace offload {
namespace {

using cuda_detail::ContextRef;
using cuda_detail::raw;

// A captured CUgraph, edited and replayed by the package.
class CudaGraph : public DeviceGraph {
 public:
  CudaGraph(ContextRef ctx, CUgraph g) : ctx_(std::move(ctx)), g_(g) {
    ctx_->make_current();
    size_t n = 0;
    CU_CHECK(DRV(cuGraphGetNodes)(g_, nullptr, &n));
    std::vector<CUgraphNode> nodes(n);
    if (n) CU_CHECK(DRV(cuGraphGetNodes)(g_, nodes.data(), &n));
    size_t e = 0;
    CU_CHECK(DRV(cuGraphGetEdges)(g_, nullptr, nullptr, nullptr, &e));
    std::vector<CUgraphNode> from(e), to(e);
    std::vector<CUgraphEdgeData> data(e);  // edges may carry data (programmatic launches): asked for, or the query fails
    if (e) CU_CHECK(DRV(cuGraphGetEdges)(g_, from.data(), to.data(), data.data(), &e));
    // Kahn's algorithm, ties broken by the driver's node order (creation order).
    std::unordered_map<CUgraphNode, size_t> index;
    for (size_t i = 0; i < n; ++i) index[nodes[i]] = i;
    std::vector<std::vector<size_t>> out(n);
    std::vector<size_t> indegree(n, 0);
    for (size_t i = 0; i < e; ++i) {
      out[index.at(from[i])].push_back(index.at(to[i]));
      ++indegree[index.at(to[i])];
    }
    std::priority_queue<size_t, std::vector<size_t>, std::greater<size_t>> ready;  // the earliest node first
    for (size_t i = 0; i < n; ++i)
      if (indegree[i] == 0) ready.push(i);
    while (!ready.empty()) {
      size_t i = ready.top();
      ready.pop();
      order_.push_back(nodes[i]);
      for (size_t j : out[i])
        if (--indegree[j] == 0) ready.push(j);
    }
    if (order_.size() != n) throw StateError("the captured graph has a cycle");
    for (CUgraphNode node : order_) {
      CUgraphNodeType t;
      CU_CHECK(DRV(cuGraphNodeGetType)(node, &t));
      types_.push_back(t);
      if (t == CU_GRAPH_NODE_TYPE_KERNEL) ++kernels_;
    }
  }
  ~CudaGraph() override {
    CU_WARN(DRV(cuCtxSetCurrent)(ctx_->get()));
    // A replay still running would have its host nodes and their copies read and write
    // the owners' memory, which goes with this graph: wait for the last one's first.
    for (CUevent e : host_done_) {
      if (launches_ > 0) CU_WARN(DRV(cuEventSynchronize)(e));
      CU_WARN(DRV(cuEventDestroy)(e));
    }
    if (exec_ != nullptr) CU_WARN(DRV(cuGraphExecDestroy)(exec_));
    CU_WARN(DRV(cuGraphDestroy)(g_));
  }

  std::size_t nodes() const override { return order_.size(); }
  std::size_t kernels() const override { return kernels_; }
  std::size_t opaque() const override { return opaque_; }
  uint64_t launches() const override { return launches_; }

  std::vector<std::vector<int>> readers(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) override {
    ctx_->make_current();
    std::vector<std::tuple<uint64_t, uint64_t, int>> sorted;
    for (size_t i = 0; i < ranges.size(); ++i) sorted.emplace_back(ranges[i].first, ranges[i].second, int(i));
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::vector<int>> found(ranges.size());
    opaque_ = 0;
    for (size_t k = 0; k < order_.size(); ++k) {
      std::vector<int> hit;
      bool readable = words(order_[k], types_[k], [&](int, size_t, size_t, uint64_t w) {
        auto it = std::upper_bound(sorted.begin(), sorted.end(), std::make_tuple(w, UINT64_MAX, INT32_MAX));
        if (it == sorted.begin()) return;
        --it;
        if (w >= std::get<0>(*it) && w < std::get<1>(*it)) hit.push_back(std::get<2>(*it));
      });
      if (!readable) ++opaque_;
      std::sort(hit.begin(), hit.end());
      hit.erase(std::unique(hit.begin(), hit.end()), hit.end());
      for (int r : hit) found[size_t(r)].push_back(int(k));
    }
    return found;
  }

  std::string kernel_name(int node) override {
    ctx_->make_current();
    CUgraphNode n = node_at(node);
    const CUgraphNodeType t = types_[size_t(node)];
    if (t != CU_GRAPH_NODE_TYPE_KERNEL) return concat("(node type ", int(t), ")");
    CUDA_KERNEL_NODE_PARAMS p{};
    CU_CHECK(DRV(cuGraphKernelNodeGetParams)(n, &p));
    const char* name = nullptr;
    const DriverApi& d = driver();
    if (p.func != nullptr && d.cuFuncGetName_ != nullptr) d.cuFuncGetName_(&name, p.func);
    if (p.func == nullptr && p.kern != nullptr && d.cuKernelGetName_ != nullptr) d.cuKernelGetName_(&name, p.kern);
    return name != nullptr ? std::string(name) : std::string("(kernel name unknown)");
  }

  std::vector<std::tuple<int, uint64_t, uint64_t>> address_in_params(int node, uint64_t lo, uint64_t hi) override {
    ctx_->make_current();
    std::vector<std::tuple<int, uint64_t, uint64_t>> found;
    CUgraphNode n = node_at(node);
    words(n, types_[size_t(node)], [&](int param, size_t size, size_t offset, uint64_t w) {
      if (param >= -1 && w >= lo && w < hi) found.emplace_back(param, uint64_t(size), uint64_t(offset));
    });
    return found;
  }

  std::vector<std::string> param_bytes(int node) override {
    ctx_->make_current();
    std::vector<std::string> out;
    CUgraphNode n = node_at(node);
    if (types_[size_t(node)] != CU_GRAPH_NODE_TYPE_KERNEL) return out;
    kernel_params(n, [&](int, const void* data, size_t size) {
      out.emplace_back(static_cast<const char*>(data), size);
    });
    return out;
  }

  void add_copies(const std::vector<GraphCopy>& copies, int in_flight) override {
    if (exec_ != nullptr) throw StateError("the graph is instantiated: no more edits");
    if (in_flight < 1) throw std::invalid_argument(concat("in_flight must be >= 1, not ", in_flight));
    ctx_->make_current();
    std::vector<CUgraphNode> made;
    for (const GraphCopy& c : copies) {
      std::vector<CUgraphNode> deps;
      if (made.size() >= size_t(in_flight)) deps.push_back(made[made.size() - size_t(in_flight)]);
      for (int i : c.after) deps.push_back(node_at(i));
      CUgraphNode node = add_copy(deps, CU_MEMORYTYPE_HOST, c.src, CU_MEMORYTYPE_DEVICE, c.dst, c.bytes);
      for (int i : c.before) {
        CUgraphNode to = node_at(i);
        CU_CHECK(DRV(cuGraphAddDependencies)(g_, &node, &to, nullptr, 1));
      }
      made.push_back(node);
    }
  }

  void add_host_matmuls(const std::vector<GraphHostMatMul>& jobs) override {
    if (exec_ != nullptr) throw StateError("the graph is instantiated: no more edits");
    if (broken_) throw StateError("an earlier edit of the graph failed part way: it cannot be used");
    int last_after = host_after_;  // the latest `after` node of the jobs so far
    // Per shared X: the latest node its one copy follows, and the earliest node that reads
    // a result computed from it (the copy must come between, or the edges make a cycle).
    std::map<std::tuple<uint64_t, uint64_t, uint64_t>, std::pair<int, int>> per_x;
    for (size_t j = 0; j < jobs.size(); ++j) {
      const GraphHostMatMul& h = jobs[j];
      if (h.job == 0 || h.x_src == 0 || h.x_host == 0 || h.y_host == 0 || h.y_dst == 0 || h.x_bytes == 0 ||
          h.y_bytes == 0)
        throw std::invalid_argument(concat("host MatMul ", j, ": a null address or an empty copy"));
      if (h.after.empty() || h.before.empty())
        throw std::invalid_argument(concat("host MatMul ", j, " has no node to follow or none to precede"));
      for (int i : h.after) node_at(i);
      for (int i : h.before) node_at(i);
      last_after = std::max(last_after, *std::max_element(h.after.begin(), h.after.end()));
      const int first_before = *std::min_element(h.before.begin(), h.before.end());
      if (first_before <= last_after)
        throw std::invalid_argument(concat("host MatMul ", j, " is read by node ", first_before,
                                           ", which is not after node ", last_after, " that it or an earlier host "
                                           "MatMul follows: host nodes run in the order given, which must be the "
                                           "graph's"));
      auto& [x_after, x_before] = per_x.try_emplace(std::make_tuple(h.x_src, h.x_host, h.x_bytes), -1, INT32_MAX)
                                      .first->second;
      x_after = std::max(x_after, *std::max_element(h.after.begin(), h.after.end()));
      x_before = std::min(x_before, first_before);
      if (x_before <= x_after)
        throw std::invalid_argument(concat("host MatMul ", j, " shares its X with a host MatMul read by node ",
                                           x_before, ", which is not after node ", x_after,
                                           " that the X's copy would follow"));
    }
    ctx_->make_current();
    try {
      // One D2H copy per X, with the captured nodes it follows (the driver refuses an
      // edge twice).
      std::map<std::tuple<uint64_t, uint64_t, uint64_t>, std::pair<CUgraphNode, std::set<int>>> d2h;
      CUgraphNode& previous = last_host_;  // the host nodes run one after another
      std::vector<CUgraphNode> last;         // the nodes that touch the owners' memory last
      for (const GraphHostMatMul& h : jobs) {
        const std::set<int> after(h.after.begin(), h.after.end()), before(h.before.begin(), h.before.end());
        const auto key = std::make_tuple(h.x_src, h.x_host, h.x_bytes);
        auto found = d2h.find(key);
        if (found == d2h.end()) {
          std::vector<CUgraphNode> deps;
          for (int i : after) deps.push_back(node_at(i));
          CUgraphNode copy = add_copy(deps, CU_MEMORYTYPE_DEVICE, h.x_src, CU_MEMORYTYPE_HOST, h.x_host, h.x_bytes);
          found = d2h.emplace(key, std::make_pair(copy, after)).first;
        } else {
          for (int i : after) {
            if (!found->second.second.insert(i).second) continue;
            CUgraphNode from = node_at(i);
            CU_CHECK(DRV(cuGraphAddDependencies)(g_, &from, &found->second.first, nullptr, 1));
          }
        }
        std::vector<CUgraphNode> deps{found->second.first};
        if (previous != nullptr) deps.push_back(previous);
        CUDA_HOST_NODE_PARAMS p{};
        p.fn = &host_matmul_job_run;
        p.userData = reinterpret_cast<void*>(uintptr_t(h.job));
        CUgraphNode host = nullptr;
        CU_CHECK(DRV(cuGraphAddHostNode)(&host, g_, deps.data(), deps.size(), &p));
        CUgraphNode copy = add_copy({host}, CU_MEMORYTYPE_HOST, h.y_host, CU_MEMORYTYPE_DEVICE, h.y_dst, h.y_bytes);
        for (int i : before) {
          CUgraphNode to = node_at(i);
          CU_CHECK(DRV(cuGraphAddDependencies)(g_, &copy, &to, nullptr, 1));
        }
        previous = host;
        last.push_back(copy);
        if (h.owner) owners_.push_back(h.owner);
      }
      host_after_ = last_after;
      if (!jobs.empty()) {
        // An event each replay records once its host nodes and their copies are done,
        // which the destructor waits for.
        last.push_back(previous);
        CUevent done = nullptr;
        CU_CHECK(DRV(cuEventCreate)(&done, CU_EVENT_DISABLE_TIMING));
        host_done_.push_back(done);
        CUgraphNode record = nullptr;
        CU_CHECK(DRV(cuGraphAddEventRecordNode)(&record, g_, last.data(), last.size(), done));
      }
    } catch (...) {
      broken_ = true;
      throw;
    }
  }

  void instantiate(Stream& s) override {
    if (exec_ != nullptr) return;
    if (broken_) throw StateError("an earlier edit of the graph failed part way: it cannot be used");
    ctx_->make_current();
    CU_CHECK(DRV(cuGraphInstantiateWithFlags)(&exec_, g_, 0));
    CU_CHECK(DRV(cuGraphUpload)(exec_, raw(s)));
  }

  void launch(Stream& s) override {
    if (exec_ == nullptr) throw StateError("the graph is not instantiated");
    ctx_->make_current();
    CU_CHECK(DRV(cuGraphLaunch)(exec_, raw(s)));
    ++launches_;
  }

 private:
  // A 1-D copy node of `bytes` from src to dst (each a device address or a host pointer,
  // by its memory type), after `deps`.
  CUgraphNode add_copy(const std::vector<CUgraphNode>& deps, CUmemorytype src_type, uint64_t src, CUmemorytype dst_type,
                       uint64_t dst, uint64_t bytes) {
    CUDA_MEMCPY3D p{};
    p.srcMemoryType = src_type;
    if (src_type == CU_MEMORYTYPE_HOST) p.srcHost = reinterpret_cast<const void*>(uintptr_t(src));
    else p.srcDevice = CUdeviceptr(src);
    p.srcPitch = bytes;
    p.srcHeight = 1;
    p.dstMemoryType = dst_type;
    if (dst_type == CU_MEMORYTYPE_HOST) p.dstHost = reinterpret_cast<void*>(uintptr_t(dst));
    else p.dstDevice = CUdeviceptr(dst);
    p.dstPitch = bytes;
    p.dstHeight = 1;
    p.WidthInBytes = bytes;
    p.Height = 1;
    p.Depth = 1;
    CUgraphNode node = nullptr;
    CU_CHECK(DRV(cuGraphAddMemcpyNode)(&node, g_, deps.data(), deps.size(), &p, ctx_->get()));
    return node;
  }

  CUgraphNode node_at(int i) const {
    if (i < 0 || size_t(i) >= order_.size()) throw std::out_of_range(concat("graph node ", i, " of ", order_.size()));
    return order_[size_t(i)];
  }

  // Calls f(index, data, size) for each parameter blob of a kernel node: every
  // parameter where the driver gives the layout, else the one packed buffer the launch
  // passed (index -1 then). False when neither is readable.
  template <class F>
  static bool kernel_params(CUgraphNode node, F&& f) {
    CUDA_KERNEL_NODE_PARAMS p{};
    CU_CHECK(DRV(cuGraphKernelNodeGetParams)(node, &p));
    if (p.kernelParams != nullptr && (p.func != nullptr || p.kern != nullptr)) {
      for (size_t i = 0;; ++i) {
        size_t offset = 0, size = 0;
        CUresult r = p.func != nullptr ? DRV(cuFuncGetParamInfo)(p.func, i, &offset, &size)
                                       : DRV(cuKernelGetParamInfo)(p.kern, i, &offset, &size);
        if (r == CUDA_ERROR_INVALID_VALUE) break;  // past the last parameter
        CU_CHECK(r);
        if (p.kernelParams[i] != nullptr) f(int(i), p.kernelParams[i], size);
      }
      return true;
    }
    if (p.extra != nullptr) {
      const void* buffer = nullptr;
      size_t size = 0;
      for (void** e = p.extra; *e != CU_LAUNCH_PARAM_END; e += 2) {
        if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = e[1];
        if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(e[1]);
      }
      if (buffer != nullptr) {
        f(-1, buffer, size);
        return true;
      }
    }
    return false;
  }

  // Calls f(param, size, offset, word) for every word of a node's parameters that may
  // be an address: each 8-byte-aligned word of a kernel's parameters (a device
  // address is 8-aligned in the parameter layout, as ld.param.u64 needs; a window at
  // 4 would join two 32-bit fields into a false address), and the device addresses of
  // a copy or a set (param -2). False when the node may read memory its parameters
  // do not show.
  template <class F>
  static bool words(CUgraphNode node, CUgraphNodeType t, F&& f) {
    switch (t) {
      case CU_GRAPH_NODE_TYPE_KERNEL:
        return kernel_params(node, [&](int param, const void* data, size_t size) {
          const auto* bytes = static_cast<const unsigned char*>(data);
          for (size_t o = 0; o + 8 <= size; o += 8) {
            uint64_t w;
            std::memcpy(&w, bytes + o, 8);
            f(param, size, o, w);
          }
        });
      case CU_GRAPH_NODE_TYPE_MEMCPY: {
        CUDA_MEMCPY3D p{};
        CU_CHECK(DRV(cuGraphMemcpyNodeGetParams)(node, &p));
        f(-2, 0, 0, uint64_t(p.srcDevice));
        f(-2, 0, 0, uint64_t(p.dstDevice));
        f(-2, 0, 0, uint64_t(reinterpret_cast<uintptr_t>(p.srcHost)));
        return true;
      }
      case CU_GRAPH_NODE_TYPE_MEMSET: {
        CUDA_MEMSET_NODE_PARAMS p{};
        CU_CHECK(DRV(cuGraphMemsetNodeGetParams)(node, &p));
        f(-2, 0, 0, uint64_t(p.dst));
        return true;
      }
      case CU_GRAPH_NODE_TYPE_GRAPH:
      case CU_GRAPH_NODE_TYPE_HOST:
        return false;
      default:  // events, waits, empty nodes: no memory
        return true;
    }
  }

  ContextRef ctx_;
  CUgraph g_;
  CUgraphExec exec_ = nullptr;
  std::vector<CUgraphNode> order_;
  std::vector<CUgraphNodeType> types_;
  std::size_t kernels_ = 0, opaque_ = 0;
  std::atomic<uint64_t> launches_{0};
  std::vector<std::shared_ptr<const void>> owners_;  // what the host nodes' memory belongs to
  std::vector<CUevent> host_done_;  // recorded by each replay once its host nodes' work is done
  bool broken_ = false;
  CUgraphNode last_host_ = nullptr;  // the last host node added, which the next one follows
  int host_after_ = -1;              // the latest `after` node of the host MatMuls added
};

}  // namespace

namespace cuda_detail {

std::shared_ptr<DeviceGraph> make_cuda_graph(ContextRef ctx, CUgraph g) { return std::make_shared<CudaGraph>(std::move(ctx), g); }

}  // namespace cuda_detail

}  // namespace offload
