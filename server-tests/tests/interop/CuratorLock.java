// Holds or tries one of Curator's lock recipes on a path, for the
// interoperability tests (compiled at test time against Debian's
// libcurator-recipes-java).
//
//   java CuratorLock <host:port> <path> <mutex|read|write|semaphore:N> hold
//       acquires, prints "held", waits for a line on stdin, releases,
//       prints "released"
//   java CuratorLock <host:port> <path> <recipe> try <ms>
//       prints "acquired" (and releases) or "timeout"
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.concurrent.TimeUnit;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessLock;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryOneTime;

public class CuratorLock {
    public static void main(String[] args) throws Exception {
        String connect = args[0], path = args[1], recipe = args[2], action = args[3];
        CuratorFramework client = CuratorFrameworkFactory.newClient(connect, 10000, 5000, new RetryOneTime(100));
        client.start();
        client.blockUntilConnected();
        if (recipe.startsWith("semaphore:")) {
            int permits = Integer.parseInt(recipe.substring("semaphore:".length()));
            InterProcessSemaphoreV2 sem = new InterProcessSemaphoreV2(client, path, permits);
            if (action.equals("hold")) {
                Lease lease = sem.acquire();
                say("held");
                new BufferedReader(new InputStreamReader(System.in)).readLine();
                sem.returnLease(lease);
                say("released");
            } else {
                Lease lease = sem.acquire(Long.parseLong(args[4]), TimeUnit.MILLISECONDS);
                if (lease == null) say("timeout"); else { say("acquired"); sem.returnLease(lease); }
            }
        } else {
            InterProcessLock lock;
            if (recipe.equals("mutex")) lock = new InterProcessMutex(client, path);
            else if (recipe.equals("read")) lock = new InterProcessReadWriteLock(client, path).readLock();
            else lock = new InterProcessReadWriteLock(client, path).writeLock();
            if (action.equals("hold")) {
                lock.acquire();
                say("held");
                new BufferedReader(new InputStreamReader(System.in)).readLine();
                lock.release();
                say("released");
            } else if (lock.acquire(Long.parseLong(args[4]), TimeUnit.MILLISECONDS)) {
                say("acquired");
                lock.release();
            } else {
                say("timeout");
            }
        }
        client.close();
    }

    static void say(String s) {
        System.out.println(s);
        System.out.flush();
    }
}
