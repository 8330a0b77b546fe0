// DataParallelTrainer: DP replicas of a TrainingEngine, gradients all-reduced before the step.
#include "brigade/engine/data_parallel.hpp"

#include "brigade/engine/threads.hpp"
#include "brigade/transport/collectives.hpp"

#include <chrono>
#include <exception>
#include <thread>

namespace brigade::engine {
inline namespace v0 {

DataParallelTrainer::DataParallelTrainer(const model::LlamaWeights& init,
                                         const TrainingConfig& config, int dp)
    : config_(config) {
  BRIGADE_CHECK(dp >= 1, Errc::InvalidArgument, "DataParallelTrainer: dp = {}, expected >= 1", dp);
  for (int r = 0; r < dp; ++r) engines_.push_back(std::make_unique<TrainingEngine>(init, config));
}

DataParallelTrainer::~DataParallelTrainer() = default;

int DataParallelTrainer::replicas() const noexcept { return static_cast<int>(engines_.size()); }

TrainingEngine& DataParallelTrainer::replica(int r) {
  BRIGADE_CHECK(r >= 0 && r < replicas(), Errc::InvalidArgument,
                "DataParallelTrainer: replica {} outside [0, {})", r, replicas());
  return *engines_[static_cast<std::size_t>(r)];
}

StepResult DataParallelTrainer::compute_gradients(std::span<const data::PackedBatch> batches) {
  const int D = replicas();
  const auto m = static_cast<std::size_t>(config_.microbatches);
  BRIGADE_CHECK(batches.size() == static_cast<std::size_t>(D) * m, Errc::InvalidArgument,
                "DataParallelTrainer: {} batches for {} replicas x {} micro-batches", batches.size(),
                D, m);
  std::vector<StepResult> res(static_cast<std::size_t>(D));
  std::vector<double> share(static_cast<std::size_t>(D), 0.0);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(D));
  transport::InProcessGroup group(D);
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < D; ++r)
      threads.emplace_back([&, r] {
        const auto i = static_cast<std::size_t>(r);
        try {
          res[i] = engines_[i]->compute_gradients(batches.subspan(i * m, m));
          BRIGADE_CHECK(!res[i].update_skipped, Errc::InvalidArgument,
                        "DataParallelTrainer: replica {} dropped every micro-batch of its share",
                        r);
          transport::InProcessCollectives member(group, r);
          const auto deadline = [&] { return transport::Deadline::after(config_.timeout_s); };
          std::vector<double> tokens{static_cast<double>(res[i].tokens)};
          member.all_reduce(std::span<double>(tokens), transport::ReduceOp::Sum, deadline());
          share[i] = static_cast<double>(res[i].tokens) / tokens[0];
          const auto w = static_cast<float>(share[i]);
          engines_[i]->for_each_gradient([&](std::span<float> g) {
            for (float& x : g) x *= w;
            member.all_reduce(g, transport::ReduceOp::Sum, deadline());
          });
        } catch (const std::exception& e) {
          errors[i] = std::current_exception();
          group.abort("DP replica " + std::to_string(r) + " failed: " + e.what());
        } catch (...) {
          errors[i] = std::current_exception();
          group.abort("DP replica " + std::to_string(r) + " failed");
        }
      });
  }
  rethrow_root_cause(errors);
  const int P = res[0].timeline.num_ranks();
  StepResult out;
  out.timeline = Timeline(D * P);
  out.origin = t0;
  std::vector<double> targets, means;
  for (const auto& x : res) {
    targets.push_back(static_cast<double>(x.tokens));
    means.push_back(x.loss);
  }
  out.loss = detail::replica_mean_loss(targets, means);
  for (int r = 0; r < D; ++r) {
    const auto& x = res[static_cast<std::size_t>(r)];
    out.tokens += x.tokens;
    if (out.task_loss.size() < x.task_loss.size()) out.task_loss.resize(x.task_loss.size());
    for (std::size_t t = 0; t < x.task_loss.size(); ++t) {
      out.task_loss[t].sum += x.task_loss[t].sum;
      out.task_loss[t].count += x.task_loss[t].count;
    }
    for (Interval iv : x.timeline.intervals()) {
      iv.rank += r * P;
      iv.start += std::chrono::duration<double>(x.origin - t0).count();
      iv.end += std::chrono::duration<double>(x.origin - t0).count();
      out.timeline.add(std::move(iv));
    }
    out.peak_memory_bytes.insert(out.peak_memory_bytes.end(), x.peak_memory_bytes.begin(),
                                 x.peak_memory_bytes.end());
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::pair<double, double> DataParallelTrainer::optimizer_step() {
  std::pair<double, double> first{};
  for (std::size_t r = 0; r < engines_.size(); ++r) {
    const auto got = engines_[r]->optimizer_step();
    if (r == 0) first = got;
  }
  return first;
}

StepResult DataParallelTrainer::train_step(std::span<const data::PackedBatch> batches) {
  const auto t0 = std::chrono::steady_clock::now();
  StepResult r = compute_gradients(batches);
  const auto [lr, norm] = optimizer_step();
  r.lr = lr;
  r.grad_norm = norm;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::map<std::string, std::vector<float>> DataParallelTrainer::gradients() const {
  return engines_.front()->gradients();
}

model::LlamaWeights DataParallelTrainer::export_weights() const {
  return engines_.front()->export_weights();
}

void DataParallelTrainer::save_checkpoint(const std::filesystem::path& dir,
                                          std::int64_t data_position) const {
  engines_.front()->save_checkpoint(dir, data_position);
}

std::int64_t DataParallelTrainer::load_optimizer_state(const std::filesystem::path& dir) {
  std::int64_t position = 0;
  for (auto& e : engines_) position = e->load_optimizer_state(dir);
  return position;
}

double DataParallelTrainer::evaluate(std::span<const data::PackedBatch> batches) {
  return engines_.front()->evaluate(batches);
}

const plan::Plan& DataParallelTrainer::plan() const noexcept { return engines_.front()->plan(); }

std::int64_t DataParallelTrainer::steps() const noexcept { return engines_.front()->steps(); }

}  // namespace v0
}  // namespace brigade::engine
