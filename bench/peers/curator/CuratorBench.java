// Curator's InterProcessMutex measured like tower-lock's bench program, same
// output format. Build and run (Debian's libcurator-recipes-java):
//
//   bench/peers/curator/run --backend zk://127.0.0.1:PORT --workload uncontended --n 2000
//   bench/peers/curator/run --backend zk://127.0.0.1:PORT --workload contended --secs 5 --workers 8
//
// Contended workers are threads of one JVM sharing one CuratorFramework (one
// session), as a Curator application would. Every release is
// InterProcessMutex.release(), which deletes the lock node and waits for the
// answer. The JIT is warmed up first: uncontended times N acquire+release after
// 500 untimed ones.
//
// The critical section of a contended cycle has no client-side lock around its
// check: an AtomicInteger counts the holders inside (an overlap when someone
// else was inside), then the holder yields once (Thread.yield(), `--hold-us 0`,
// the default) or sleeps `--hold-us` microseconds so that a second holder could
// run while it is inside, then leaves and releases. Cycles begun in the first
// 500 ms are a warm-up and not counted; cycles_per_s is the counted cycles over
// the time they took (end of warm-up until the last of them ended). Overlaps are
// counted over the whole run.
//
//   bench/peers/curator/run --backend zk://127.0.0.1:PORT --workload contended --secs 5 --no-lock
//
// is the negative control: the same loop without the lock. It must report
// overlaps>0, which proves the check can fail.
//
// `--section-log FILE`: one of several processes on the key, run by
// bench/peers/processes.py (see peer_harness.py for the log's lines).
import java.io.FileOutputStream;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.locks.LockSupport;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryOneTime;

public class CuratorBench {
    public static void main(String[] args) throws Exception {
        String backend = null, workload = null;
        int n = 2000, secs = 5, workers = 8;
        long holdUs = 0;
        boolean noLock = false;
        String sectionLog = null;
        for (int i = 0; i < args.length; i++) {
            switch (args[i]) {
                case "--backend": backend = args[++i]; break;
                case "--workload": workload = args[++i]; break;
                case "--n": n = Integer.parseInt(args[++i]); break;
                case "--secs": secs = Integer.parseInt(args[++i]); break;
                case "--workers": workers = Integer.parseInt(args[++i]); break;
                case "--hold-us": holdUs = Long.parseLong(args[++i]); break;
                case "--no-lock": noLock = true; break;
                case "--section-log": sectionLog = args[++i]; break;
                default: throw new IllegalArgumentException(args[i]);
            }
        }
        if (holdUs < 0) usage("--hold-us must be at least 0");
        if ((noLock || sectionLog != null) && !"contended".equals(workload))
            usage("--no-lock and --section-log apply to the contended workload");
        if (sectionLog != null) log = new FileOutputStream(sectionLog, true);
        String hosts = backend.replaceFirst("^zk://", "").split("/")[0];
        CuratorFramework client = CuratorFrameworkFactory.newClient(hosts, 10000, 5000, new RetryOneTime(100));
        client.start();
        client.blockUntilConnected();
        String line = workload.equals("uncontended") ? uncontended(client, n) : contended(client, workers, secs, holdUs, noLock);
        String name = noLock ? "no-lock-curator" : "curator";
        // An ensemble says so, as the bench program's lines do.
        int servers = hosts.split(",").length;
        String setting = servers > 1 ? " servers=" + servers : "";
        System.out.println("impl=" + name + " backend=zookeeper workload=" + workload + setting + " " + line);
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

    /** The section log of a process of a group, or null. */
    static FileOutputStream log;

    /** Appends `what pid unix_ns` to the section log, in one write. */
    static void logSection(char what) throws IOException {
        if (log == null) return;
        Instant now = Instant.now();
        long ns = now.getEpochSecond() * 1_000_000_000L + now.getNano();
        log.write((what + " " + ProcessHandle.current().pid() + " " + ns + "\n").getBytes(StandardCharsets.US_ASCII));
    }

    /** Cycles begun this long after the workers start are the first counted. */
    static final long WARM_UP_MS = 500;

    static String contended(CuratorFramework client, int workers, int secs, long holdUs, boolean noLock)
            throws Exception {
        AtomicBoolean stop = new AtomicBoolean(), counting = new AtomicBoolean();
        AtomicInteger inside = new AtomicInteger(), overlaps = new AtomicInteger();
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
                        boolean counted = counting.get();
                        long t = System.nanoTime();
                        if (!noLock) lock.acquire();
                        long waited = System.nanoTime() - t;
                        logSection('E');
                        // The critical section: no lock around the check.
                        if (inside.incrementAndGet() != 1) overlaps.incrementAndGet();
                        hold(holdUs);
                        inside.decrementAndGet();
                        logSection('L');
                        if (!noLock) lock.release();
                        if (counted) {
                            mine.add(waited);
                            counts[id]++;
                        }
                    }
                } catch (Exception e) {
                    throw new RuntimeException(e);
                }
            });
        }
        for (Thread t : threads) t.start();
        Thread.sleep(WARM_UP_MS);
        counting.set(true);
        long started = System.nanoTime();
        Thread.sleep(secs * 1000L);
        stop.set(true);
        for (Thread t : threads) t.join();
        // Cycles begun before the stop are counted, so is the time they took.
        double elapsed = (System.nanoTime() - started) / 1e9;
        long total = 0;
        int min = Integer.MAX_VALUE, max = 0;
        for (int c : counts) { total += c; min = Math.min(min, c); max = Math.max(max, c); }
        long[] all = perWorker.stream().flatMap(List::stream).mapToLong(Long::longValue).sorted().toArray();
        return "workers=" + workers + " secs=" + secs + " cycles_per_s=" + Math.round(total / elapsed)
            + " wait_p50_us=" + us(pct(all, 0.5)) + " wait_p99_us=" + us(pct(all, 0.99))
            + " per_worker_min=" + min + " per_worker_max=" + max + " overlaps=" + overlaps.get();
    }

    /**
     * Yields once (zero) or sleeps {@code us} microseconds. Not Thread.sleep:
     * before JDK 21 it rounds any nanos up to a whole millisecond.
     */
    static void hold(long us) {
        if (us == 0) {
            Thread.yield();
            return;
        }
        long deadline = System.nanoTime() + us * 1000;
        for (long left = us * 1000; left > 0; left = deadline - System.nanoTime()) {
            LockSupport.parkNanos(left);
        }
    }

    static void usage(String message) {
        System.err.println("CuratorBench: " + message);
        System.exit(2);
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
