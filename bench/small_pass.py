"""A small statistics pass (5 tensors of 5 elements) and a large one (4 x 2^18) through
trainsan.tensor_stats with 2 threads, median us per pass: whether a small pass wakes the thread pool
(issue 23). Run it alone, then with other processes on the cores."""
import time, torch, trainsan, statistics
torch.set_num_threads(2)
ts = [torch.randn(5) for _ in range(5)]
for _ in range(200): trainsan.tensor_stats(ts)
rs = []
for r in range(5):
    t0 = time.perf_counter()
    for _ in range(2000): trainsan.tensor_stats(ts)
    rs.append((time.perf_counter() - t0) / 2000 * 1e6)
big = [torch.randn(1 << 18) for _ in range(4)]
rb = []
for r in range(5):
    t0 = time.perf_counter()
    for _ in range(50): trainsan.tensor_stats(big)
    rb.append((time.perf_counter() - t0) / 50 * 1e6)
print(f"5x5 elements: {statistics.median(rs):.1f} us/pass; 4x2^18: {statistics.median(rb):.0f} us/pass")
