
import time
from tests.conformance.conftest import run_scenario
def test_x(server):
    t=time.time(); out = run_scenario(server, "s9_lifecycle"); print("\nSCEN", time.time()-t, out, "end", time.time())
