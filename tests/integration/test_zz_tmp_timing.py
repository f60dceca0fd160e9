import time
from loadgen import KinferClient, ClientError

def test_t(broker):
    topics = broker.topics(requests=3, replies=2)
    for i in range(3):
        t = time.monotonic()
        try:
            KinferClient(broker.bootstrap_servers, "no-such-topic-x1", topics["replies"]).start()
        except ClientError:
            pass
        print("fail", time.monotonic() - t)
        t = time.monotonic()
        k = KinferClient(broker.bootstrap_servers, topics["requests"], topics["replies"]).start()
        print("start", time.monotonic() - t)
        t = time.monotonic()
        k._consumer.list_topics(timeout=10)
        print("list", time.monotonic() - t)
        t = time.monotonic()
        k.close()
        print("close", time.monotonic() - t)
