// Curator's InterProcessMutex measured like tower-lock's bench program, same
// output format. Build and run (Debian's libcurator-recipes-java):
//
//   bench/peers/curator/run --backend zk://127.0.0.1:PORT --workload uncontended --n 2000
//   bench/peers/curator/run --backend zk://127.0.0.1:PORT --workload contended --secs 5 --workers 8
//
// Contended workers are threads of one JVM sharing one CuratorFramework (one
// session), as a Curator application would. The JIT is warmed up first.
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryOneTime;

public class CuratorBench {
    public static void main(String[] args) throws Exception {
        String backend = null, workload = null;
        int n = 2000, secs = 5, workers = 8;
        for (int i = 0; i < args.length; i += 2) {
            switch (args[i]) {
                case "--backend": backend = args[i + 1]; break;
                case "--workload": workload = args[i + 1]; break;
                case "--n": n = Integer.parseInt(args[i + 1]); break;
                case "--secs": secs = Integer.parseInt(args[i + 1]); break;
                case "--workers": workers = Integer.parseInt(args[i + 1]); break;
                default: throw new IllegalArgumentException(args[i]);
            }
        }
        String hosts = backend.replaceFirst("^zk://", "").split("/")[0];
        CuratorFramework client = CuratorFrameworkFactory.newClient(hosts, 10000, 5000, new RetryOneTime(100));
        client.start();
        client.blockUntilConnected();
        String line = workload.equals("uncontended") ? uncontended(client, n) : contended(client, workers, secs);
        System.out.println("impl=curator backend=zookeeper workload=" + workload + " " + line);
        client.close();
    }

    static String uncontended(CuratorFramework client, int n) throws Exception {
        InterProcessMutex lock = new InterProcessMutex(client, "/bench-curator/uncontended");
        for (int i = 0; i < 500; i++) { lock.acquire(); lock.release(); }
        long[] samples = new long[n];
        for (int i = 0; i < n; i++) {
            long t = System.nanoTime();
            lock.acquire();
            lock.release();
            samples[i] = System.nanoTime() - t;
        }
        Arrays.sort(samples);
        return "n=" + n + " p50_us=" + us(pct(samples, 0.5)) + " p99_us=" + us(pct(samples, 0.99));
    }

    static String contended(CuratorFramework client, int workers, int secs) throws Exception {
        AtomicBoolean stop = new AtomicBoolean();
        AtomicInteger inside = new AtomicInteger(), overlaps = new AtomicInteger();
        List<long[]> waits = new ArrayList<>();
        int[] counts = new int[workers];
        List<List<Long>> perWorker = new ArrayList<>();
        Thread[] threads = new Thread[workers];
        for (int w = 0; w < workers; w++) {
            final int id = w;
            List<Long> mine = new ArrayList<>();
            perWorker.add(mine);
            threads[w] = new Thread(() -> {
                InterProcessMutex lock = new InterProcessMutex(client, "/bench-curator/contended");
                try {
                    while (!stop.get()) {
                        long t = System.nanoTime();
                        lock.acquire();
                        mine.add(System.nanoTime() - t);
                        if (inside.incrementAndGet() != 1) overlaps.incrementAndGet();
                        inside.decrementAndGet();
                        lock.release();
                        counts[id]++;
                    }
                } catch (Exception e) {
                    throw new RuntimeException(e);
                }
            });
        }
        long started = System.nanoTime();
        for (Thread t : threads) t.start();
        Thread.sleep(secs * 1000L);
        stop.set(true);
        for (Thread t : threads) t.join();
        double elapsed = (System.nanoTime() - started) / 1e9;
        long total = 0;
        int min = Integer.MAX_VALUE, max = 0;
        for (int c : counts) { total += c; min = Math.min(min, c); max = Math.max(max, c); }
        long[] all = perWorker.stream().flatMap(List::stream).mapToLong(Long::longValue).sorted().toArray();
        return "workers=" + workers + " secs=" + secs + " cycles_per_s=" + Math.round(total / elapsed)
            + " wait_p50_us=" + us(pct(all, 0.5)) + " wait_p99_us=" + us(pct(all, 0.99))
            + " per_worker_min=" + min + " per_worker_max=" + max + " overlaps=" + overlaps.get();
    }

    static long pct(long[] sorted, double p) {
        int i = Math.max(1, Math.min(sorted.length, (int) Math.ceil(sorted.length * p))) - 1;
        return sorted[i];
    }

    static String us(long nanos) {
        double v = nanos / 1000.0;
        return v < 10 ? String.format("%.2f", v) : String.valueOf(Math.round(v));
    }
}
