// Status strings, the thread-local last error, the version.
#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "precis/precis.h"

namespace {

// Makes a call fail with a message that contains `tag`.
precis_status_t FailWith(const std::string& tag) {
  precis_dtype_t d;
  return precis_dtype_from_name(tag.c_str(), &d);
}

TEST(Errors, EveryStatusHasItsOwnString) {
  std::set<std::string> seen;
  for (int s = 0; s < PRECIS_STATUS_COUNT; ++s) {
    const char* text = precis_status_string(static_cast<precis_status_t>(s));
    ASSERT_NE(text, nullptr);
    EXPECT_GT(std::strlen(text), 0u) << s;
    EXPECT_STRNE(text, "unknown status") << s;
    EXPECT_TRUE(seen.insert(text).second) << "duplicate string for status " << s;
  }
  EXPECT_STREQ(precis_status_string(PRECIS_OK), "success");
}

TEST(Errors, OutOfRangeStatusIsUnknown) {
  for (int s : {-1, static_cast<int>(PRECIS_STATUS_COUNT), 99, -1000}) {
    EXPECT_STREQ(precis_status_string(static_cast<precis_status_t>(s)), "unknown status") << s;
  }
}

TEST(Errors, StatusCodesAreStable) {
  // The Python layer mirrors these numbers.
  EXPECT_EQ(PRECIS_OK, 0);
  EXPECT_EQ(PRECIS_ERR_NULL_POINTER, 1);
  EXPECT_EQ(PRECIS_ERR_INVALID_ARGUMENT, 2);
  EXPECT_EQ(PRECIS_ERR_INVALID_DTYPE, 3);
  EXPECT_EQ(PRECIS_ERR_INVALID_POLICY, 4);
  EXPECT_EQ(PRECIS_ERR_SIZE_MISMATCH, 5);
  EXPECT_EQ(PRECIS_ERR_UNSUPPORTED, 6);
  EXPECT_EQ(PRECIS_ERR_CUDA, 7);
  EXPECT_EQ(PRECIS_ERR_OUT_OF_MEMORY, 8);
}

TEST(Errors, Version) {
  EXPECT_EQ(precis_version(), PRECIS_VERSION_CODE);
  EXPECT_EQ(precis_version(),
            PRECIS_VERSION_MAJOR * 10000 + PRECIS_VERSION_MINOR * 100 + PRECIS_VERSION_PATCH);
}

TEST(Errors, LastErrorIsSetByFailureAndClearedBySuccess) {
  ASSERT_EQ(FailWith("no_such_dtype"), PRECIS_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(precis_last_error()).find("no_such_dtype"), std::string::npos);
  size_t size = 0;
  ASSERT_EQ(precis_dtype_size(PRECIS_DTYPE_FP32, &size), PRECIS_OK);
  EXPECT_STREQ(precis_last_error(), "");
}

TEST(Errors, FreshThreadHasNoError) {
  ASSERT_EQ(FailWith("main_thread_tag"), PRECIS_ERR_INVALID_DTYPE);
  std::string seen = "not run";
  std::thread([&] { seen = precis_last_error(); }).join();
  EXPECT_EQ(seen, "");
}

TEST(Errors, MessagesDoNotLeakAcrossThreads) {
  ASSERT_EQ(FailWith("main_thread_tag"), PRECIS_ERR_INVALID_DTYPE);
  std::string other;
  std::thread([&] {
    FailWith("other_thread_tag");
    other = precis_last_error();
  }).join();
  EXPECT_NE(other.find("other_thread_tag"), std::string::npos);
  EXPECT_EQ(other.find("main_thread_tag"), std::string::npos);
  std::string mine = precis_last_error();
  EXPECT_NE(mine.find("main_thread_tag"), std::string::npos);
  EXPECT_EQ(mine.find("other_thread_tag"), std::string::npos);
}

TEST(Errors, ConcurrentFailuresKeepTheirOwnMessages) {
  constexpr int kThreads = 8;
  constexpr int kIters = 2000;
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &mismatches] {
      const std::string tag = "tag_of_thread_" + std::to_string(t) + "_";
      for (int i = 0; i < kIters; ++i) {
        FailWith(tag);
        std::string msg = precis_last_error();
        if (msg.find(tag) == std::string::npos) ++mismatches;
        for (int u = 0; u < kThreads; ++u) {
          if (u != t && msg.find("tag_of_thread_" + std::to_string(u) + "_") != std::string::npos)
            ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Errors, LongMessagesAreTruncatedNotOverflowed) {
  std::string huge(5000, 'x');
  ASSERT_EQ(FailWith(huge), PRECIS_ERR_INVALID_DTYPE);
  const char* msg = precis_last_error();
  EXPECT_LT(std::strlen(msg), 1024u);
  EXPECT_EQ(std::string(msg).rfind("dtype: '", 0), 0u);
}

}  // namespace
